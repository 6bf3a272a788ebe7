"""Learned prompts in and out of the repository.

    from coop.interop import import_checkpoint, export_run, load_classifier
    import_checkpoint("maple", "output/.../model.pth.tar-5", "runs/imported/maple_dtd", ["data.name=dtd"])
    export_run("runs/imported/maple_dtd", "maple_dtd.safetensors")      # tensors + a metadata card
    clf = load_classifier("maple_dtd.safetensors")                      # or the run folder
    probs = clf.predict(clf.transform(image).unsqueeze(0))              # (1, n_cls)

`dassl` reads the originals' checkpoint files (tensors only), `names` maps their state-dict names
to ours, `importer` writes a run folder from them; `export` writes and reads the safetensors
files, `classifier` turns a run or an exported file into a classifier, and `federated` picks a
federated run's global model or one client's.

The interop layer, below coop.tta only: may import coop.federated (a federated run's global or
client model), coop.train, coop.methods, coop.model, coop.data, coop.config and the root
modules. Imported by: coop.tta (the host of a test-time pass), coop/__init__.py (load_classifier)
and the tools.
"""

from coop.interop.classifier import Classifier, load_classifier
from coop.interop.dassl import InteropError, OriginalCheckpointError, read_state_dict
from coop.interop.export import ExportError, export_run, read_export
from coop.interop.importer import ImportShapeError, import_checkpoint
from coop.interop.names import IMPORTABLE, MappingError, map_names

__all__ = [
    "IMPORTABLE",
    "Classifier",
    "ExportError",
    "ImportShapeError",
    "InteropError",
    "MappingError",
    "OriginalCheckpointError",
    "export_run",
    "import_checkpoint",
    "load_classifier",
    "map_names",
    "read_export",
    "read_state_dict",
]
