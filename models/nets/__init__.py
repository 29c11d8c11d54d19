"""PyTorch network definitions.

Imported only by training, export and import commands: nothing in the serving path (``service/``,
``models.embedder``) may import this package, because it needs torch.
"""
