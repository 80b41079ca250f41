"""SGLang for kvcc: a HiCache storage backend (``KvccHiCacheStorage``, ``kvcc.adapters.sglang.backend``)
that SGLang's own ``dynamic`` backend factory loads. Needs the ``sglang`` extra (scripts/setup.sh);
on a CPU machine only SGLang's storage classes run, never its server."""
