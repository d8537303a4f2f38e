"""``python -m hvdtrain.strategies``: prints docs/compatibility.md."""

from hvdtrain.strategies.page import markdown

print(markdown(), end="")
