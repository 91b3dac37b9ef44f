"""Writing the trained model as a Hugging Face folder without ever mixing two models.

Every rank writes its shards into a staging folder beside the target (``.NAME.dflop-export``,
a name only dflop uses); rank 0 completes it (index, config, processor files, adapters) and
then publishes it: renamed into place where the target is new or empty, or, with
``save_hf_replace``, swapped with the old folder, which is then removed. A run that dies
mid-export leaves the target as it was (and a staging folder the next export removes).
:func:`~dflop.train.config.check_export_folder` refuses, before training, a target that
holds files (without ``save_hf_replace``) or that is, holds or lies in the input model's
folder.
"""

from __future__ import annotations

import os
import shutil

__all__ = ["begin_export", "publish_export", "staging_folder"]


def _sibling(folder: str, suffix: str) -> str:
    path = os.path.abspath(folder)
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.dflop-{suffix}")


def staging_folder(folder: str) -> str:
    """Where the ranks write the model bound for ``folder``."""
    return _sibling(folder, "export")


def begin_export(folder: str) -> str:
    """Rank 0, before any rank writes: an empty staging folder for ``folder`` (one left by
    a run that died mid-export is removed first); returns its path."""
    staging = staging_folder(folder)
    if os.path.lexists(staging):
        shutil.rmtree(staging)
    os.makedirs(staging)
    return staging


def publish_export(folder: str, replace: bool) -> None:
    """Rank 0, once the staging folder is complete: it becomes ``folder``. A non-empty
    ``folder`` is replaced as a whole when ``replace`` (swapped by two renames, the old one
    then removed), else refused (it filled up while the run trained; the staging folder is
    removed, the folder untouched)."""
    staging = staging_folder(folder)
    if os.path.isdir(folder) and os.listdir(folder):
        if not replace:
            shutil.rmtree(staging)
            raise ValueError(
                f"--save-hf {folder}: the folder is no longer empty (files appeared while the "
                "run trained); nothing was written to it: export again into a new folder, or "
                "with --save-hf-replace"
            )
        old = _sibling(folder, "replaced")
        if os.path.lexists(old):
            shutil.rmtree(old)
        os.rename(folder, old)
        os.rename(staging, folder)
        _remove(old)
        return
    if os.path.lexists(folder):
        _remove(folder)  # empty (or a link: what it leads to is left as it is)
    else:
        os.makedirs(os.path.dirname(os.path.abspath(folder)), exist_ok=True)
    os.rename(staging, folder)


def _remove(path: str) -> None:
    """A folder dflop replaced, or a symbolic link to one (only the link goes)."""
    if os.path.islink(path):
        os.unlink(path)
    else:
        shutil.rmtree(path)
