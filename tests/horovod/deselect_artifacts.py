"""A pytest plugin for `make test-horovod`: deselects exactly the tests named in
HVDTRAIN_DESELECT (one node id a line). pytest's own --deselect matches prefixes, which would also
drop test_broadcast_state_gpu along with test_broadcast_state."""

import os


def pytest_collection_modifyitems(config, items):
    """Moves the named tests (whole node id, or the id without its subtest parameters) aside."""
    names = set(filter(None, os.environ.get("HVDTRAIN_DESELECT", "").splitlines()))
    keep, drop = [], []
    for item in items:
        (drop if item.nodeid in names else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
