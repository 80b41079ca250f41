"""SGLang for kvcc: a HiCache storage backend (``KvccHiCacheStorage``, ``kvcc.adapters.sglang.backend``)
that SGLang's own ``dynamic`` backend factory loads. Needs the ``sglang`` extra (scripts/setup.sh);
on a CPU machine only SGLang's storage classes run, never its server.

Under the conformance suite: ``conformance`` (adapter ``sglang``: that backend on a real kvcc
cluster) and ``hicache_file`` (adapter ``hicache-file``: SGLang's own ``HiCacheFile``, nothing
added). Importing this package imports neither SGLang nor torch."""
