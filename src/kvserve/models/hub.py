"""Hugging Face Hub model ids (`Qwen/Qwen2.5-0.5B-Instruct`) as checkpoint folders, as vLLM and
transformers take them: the files the engine reads are downloaded into the Hub's cache (or a
`download_dir`) once, with a progress bar, and found there again, offline too
(`HF_HUB_OFFLINE=1`). Gated models read the token of `HF_TOKEN` or `hf auth login`."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from kvserve.errors import CheckpointError

logger = logging.getLogger(__name__)

# The files a checkpoint folder needs: configs, safetensors weights and their index,
# tokenizers (tokenizer.json, or the files slower tokenizers build from) and chat templates.
# Pickled weights, GGUF files and the like never are.
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model(model: str, revision: str | None = None, download_dir: str | None = None,
                  field: str = "model") -> str:
    """`model` itself where it is a folder here, or the folder of the Hub model it names
    (at `revision`: a branch, tag or commit; default main). Anything else passes unchanged,
    for the config reader to report. Errors name `field`."""
    if Path(model).expanduser().is_dir() or not _HUB_ID.fullmatch(model):
        return model
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    reasons = {
        GatedRepoError: "it is gated: accept its terms on the Hub, then set HF_TOKEN",
        RepositoryNotFoundError: "no such model on the Hub (or it is private: set HF_TOKEN)",
        RevisionNotFoundError: f"it has no revision {revision!r}",
        LocalEntryNotFoundError: "the Hub cannot be reached and it is not in the cache",
    }
    try:
        folder = snapshot_download(model, revision=revision, cache_dir=download_dir,
                                   allow_patterns=HUB_FILES)
    except (HfHubHTTPError, HFValidationError, OSError) as e:
        reason = next((text for kind, text in reasons.items() if isinstance(e, kind)),
                      str(e).splitlines()[0] if str(e) else type(e).__name__)
        raise CheckpointError(f"{field}: {model!r} is not a folder here, and the Hugging Face "
                              f"Hub cannot give it: {reason}") from None
    logger.info("model %s%s: %s", model, f" ({revision})" if revision else "", folder)
    return folder
