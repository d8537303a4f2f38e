"""Parameter servers beside Horovod's ring (``comm.topology=ps``): framework-free.

Server processes import NumPy and mpi4py only (:mod:`hvdtrain.ps.server`, and under
``ps.consistency=ssp``/``asp`` :mod:`hvdtrain.ps.async_server`, which runs
:mod:`hvdtrain.ps.optim`'s optimizer on its shard); workers reach them through
:class:`hvdtrain.ps.client.PSClient` (:class:`~hvdtrain.ps.client.AsyncPSClient`), which the ``ps``
gradient exchange (:mod:`hvdtrain.ps.exchange`) drives. :mod:`hvdtrain.ps.mpi` splits the job
into workers and servers where the layout of ranks (:mod:`hvdtrain.layout`) puts them;
:mod:`hvdtrain.ps.layout` says which server owns which chunk of the flat
gradient and :mod:`hvdtrain.ps.shards` cuts vectors and optimizer state into those shards;
:mod:`hvdtrain.ps.protocol` is what travels between them and :mod:`hvdtrain.ps.codec` what a
chunk travels as under each ``comm.compression`` method. The sharded update that once stood
here as colocated servers is sharded data parallel now (``shard.stage=1``,
:mod:`hvdtrain.shard`). See docs/parameter-servers.md.
"""
