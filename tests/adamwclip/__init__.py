"""AdamWClip: ``clipjax.adamw(..., clip_grad_adapt=...)`` against the ``adamwclip`` package."""
