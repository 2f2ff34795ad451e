"""What runs inside each rank process: the worker that loads the call and writes its result
(``worker``, ``results``) and the watchdog that reports a stuck rank (``watchdog``)."""
