"""The model outside spes: read a trained model back (``saved.py``), write it as a Hugging Face transformers
folder (``hf_export.py``), and sample text from it (``spes_p2p.model.sampling`` does the sampling itself).

Nothing here imports transformers: an exported folder is plain safetensors and JSON in the layout that
transformers reads. Only the tests, and users who load the folder, need it (``pip install spes-p2p[hf]``).
"""
