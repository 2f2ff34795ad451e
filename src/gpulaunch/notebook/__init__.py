"""The notebook experience: a live run panel inside a Jupyter kernel (``callback.py`` hooks it
into every launch; ``model.py`` is its pure state from the run directory; ``view.py`` renders
it with ipywidgets, the optional extra ``gpulaunch[notebook]``)."""
