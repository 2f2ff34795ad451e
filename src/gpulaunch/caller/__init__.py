"""The caller's side of a launch: settings → spec (``spec``), the one launch pipeline
(``pipeline``), following a run (``handle``, ``logstream``), collecting its outcome from the run
directory (``collect``) and turning it into results or one error (``outcome``), plus the run
callbacks (``callbacks``) that side concerns such as tracking plug into."""
