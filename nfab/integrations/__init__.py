"""nfab inside the training frameworks users already run: Lightning, Accelerate, the Transformers Trainer.

Each submodule imports its framework when it is imported itself, never from `import nfab`:
install the matching extra (`pip install 'nfab[lightning]'`, `'nfab[accelerate]'`,
`'nfab[transformers]'`) and import `nfab.integrations.<framework>`. All three register the
same hook as `nfab.attach` on the DDP model the framework built, and pass any further
keyword arguments to `nfab.attach` untouched. Transformers and Lightning also `calibrate` from
the objects the user built for them (the Trainer; the LightningModule and its datamodule),
writing the profile their adapter then attaches; an Accelerate loop calls `nfab.calibrate` with
its own model factory, dataset and loss.
"""
