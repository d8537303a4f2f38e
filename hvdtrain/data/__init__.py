"""Datasets and how they reach the engines; framework-free.

- :mod:`hvdtrain.data.contracts`: a :class:`~hvdtrain.data.contracts.Dataset` gives two
  map-style :class:`~hvdtrain.data.contracts.Source` splits (a length and a batch loaded by sample
  index); :class:`~hvdtrain.data.contracts.Split` is the in-memory one.
- :mod:`hvdtrain.data.sampler`: the global-batch sampler (every sample once per epoch, resumable
  mid-epoch, re-shardable across an elastic resize, the same order in both frameworks) and the
  evaluation shards.
- :mod:`hvdtrain.data.tree`: nested structures (tuples, lists, dicts) of arrays, the form a
  batch's inputs and targets take.
- :mod:`hvdtrain.data.loading`: what both frameworks' parallel loaders share: the requests they
  fetch, where their stream stands in an epoch's plan, bad-data reports, worker defaults.
- Formats by name: :mod:`~hvdtrain.data.digits`, :mod:`~hvdtrain.data.mnist1d`,
  :mod:`~hvdtrain.data.synthetic` (``synthetic_images``), :mod:`~hvdtrain.data.image_folder`,
  :mod:`~hvdtrain.data.npy`, :mod:`~hvdtrain.data.text` (a tokenized corpus: windows of tokens and
  their next tokens; ``make_text`` writes one from text files); :mod:`~hvdtrain.data.augment`
  draws augmentation from ``(seed, epoch, sample index)``; :mod:`~hvdtrain.data.make_images`
  writes a JPEG data set.

The framework halves of loading live in ``hvdtrain/torch/data.py`` and
``hvdtrain/tensorflow/data.py``.
"""
