"""Everything about a face model that training, evaluation and serving share.

The single face path, the same for every component (a face cut differently for training,
evaluation and serving costs accuracy)::

    bytes -> decode_image -> MTCNNDetector.detect -> align_faces -> Embedder.embed -> cosine

Nothing in this package imports torch at import time; the PyTorch network definitions under
``models.nets`` are imported only by training, export and import commands.
"""
