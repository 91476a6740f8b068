"""The suite's layout follows the package's folders (docs/layout.md); the shared helpers ``_dist`` and ``_models``
sit here, and pytest puts this folder on ``sys.path`` because this file is in it.

The ranks of ``run_ranks`` fork from one fork server per session ([Note: forked ranks] in
tiershard/cluster/local.py), which imports ``local.PRELOAD``. The suite adds the modules every rank imports on its
first ``ts.shard``, step or save (DTensor, torch._dynamo behind DTensor's ``torch._disable_dynamo``, FSDP2, DCP, the
runtime): imported once in the server instead of once per rank per launch, about 0.6 s of CPU each on 2 cores.
Imports only (no threads, no process group), and none of them reads an environment variable that a test changes
between launches; transformers stays out (tiershard.runtime.materialize looks for it in ``sys.modules``)."""
from tiershard.cluster import local as _local

_local.PRELOAD.extend(m for m in ("torch.distributed.tensor", "torch.distributed.tensor.parallel",
                                  "torch.distributed.fsdp", "torch.distributed.checkpoint", "torch._dynamo",
                                  "tiershard.runtime.api", "tiershard.checkpoint") if m not in _local.PRELOAD)
