"""nfab inside the training frameworks users already run: Lightning, Accelerate, the Transformers Trainer.

Each submodule imports its framework when it is imported itself, never from `import nfab`:
install the matching extra (`pip install 'nfab[lightning]'`, `'nfab[accelerate]'`,
`'nfab[transformers]'`) and import `nfab.integrations.<framework>`. All three register the
same hook as `nfab.attach` on the DDP model the framework built, and pass any further
keyword arguments to `nfab.attach` untouched.
"""
