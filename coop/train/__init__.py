"""The training layer: one run, from a config to a run folder, and grids of runs.

engine.py (a training epoch on features or pixels, evaluation), run_features.py (the image
features of a run's splits), runner.py (run folders: resume, checkpoints, metrics), schedule.py
(optimizers, lr schedules, iteration budgets), checkpoint.py (save, safe load), features.py (the
image-feature cache), precision.py (what train.precision runs on a device, and its autocast),
lock.py (one writer per run folder), evaluation.py (eval.targets, saved checkpoints), preflight.py
(the model, its weights and tokenizer, and the model-bounded config checks, before a run folder
exists), metrics.py (accuracy, macro F1, per class and per domain), tensorboard.py (a run's event
files), sweep.py and sweep_submitit.py (grids of runs).

May import: coop.methods, coop.model, coop.data, coop.config and the root modules (coop.io,
coop.distributed). Imported by: coop.results, coop.federated, coop.interop and the tools.
"""
