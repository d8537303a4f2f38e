"""Parameter servers beside Horovod's ring (``comm.topology=ps``): framework-free.

Server processes import NumPy and mpi4py only (:mod:`hvdtrain.ps.server`); workers reach them
through :class:`hvdtrain.ps.client.PSClient`, which the ``ps`` gradient exchange
(:mod:`hvdtrain.ps.exchange`) drives. :mod:`hvdtrain.ps.world` splits the job into workers and
servers; :mod:`hvdtrain.ps.layout` says which server owns which chunk of the flat gradient;
:mod:`hvdtrain.ps.protocol` is what travels between them. Colocated servers
(``ps.placement=colocated``, the sharded update) have no server processes:
:mod:`hvdtrain.ps.colocated` says which slice of the flat parameters each worker owns (the PyTorch side is
:mod:`hvdtrain.torch.colocated`). See docs/parameter-servers.md.
"""
