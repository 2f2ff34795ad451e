"""What every process of a run shares: the typed records that cross process boundaries
(``records``, serialised by ``serde``), the run directory that holds them (``rundir``), the
pickled call (``payload``), waits and defaults (``constants``) and process helpers
(``procutil``). Nothing here imports torch or any other part of gpulaunch but ``errors`` and
``hardware``."""
