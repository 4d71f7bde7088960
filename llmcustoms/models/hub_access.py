"""Whether the Hugging Face Hub can be reached, and which models load without it.

huggingface_hub retries an unreachable Hub for about a minute per file, with a
warning line per retry; a user without network saw a dozen of them before
`plan` went on. So, the first time a command needs the Hub (a model that is not
in the local cache), one request with a short timeout decides; if the Hub does
not answer, the rest of the command runs as with `HF_HUB_OFFLINE=1`, and the
user is told once (`offline_note`).
"""

from __future__ import annotations

import errno
import os
import socket
import urllib.error
import urllib.request
from functools import lru_cache
from pathlib import Path

from llmcustoms.planning.plan import ModelChoice

# Long enough for a slow link to answer, short enough that offline costs little.
CHECK_TIMEOUT_S = 3.0

# Short: a column of the `hardware` table at 80 characters.
LOCAL, CACHED, DOWNLOADABLE, UNAVAILABLE = "local", "cached", "download", "offline: no"


def offline_by_setting() -> bool:
    return any(os.environ.get(name, "").lower() in ("1", "true", "yes", "on")
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


@lru_cache(maxsize=1)
def hub_reachable() -> bool:
    """One HEAD request to the Hub's endpoint, once per process. Any HTTP answer,
    even an error status, means it is reachable; no answer in time means not,
    and the process goes offline (`_go_offline`)."""
    if offline_by_setting():
        return False
    from huggingface_hub import constants

    try:
        with urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"),
                                    timeout=CHECK_TIMEOUT_S):
            return True
    except urllib.error.URLError as error:
        reason = error.reason if not isinstance(error, urllib.error.HTTPError) else None
        if not _no_network(reason):
            return True  # it answered (an error status, a certificate urllib does not trust): huggingface_hub decides
    except OSError as error:
        if not _no_network(error):
            return True
    except Exception:  # a malformed answer or endpoint: not ours to judge; huggingface_hub decides
        return True
    _go_offline()
    return False


def _no_network(reason: object) -> bool:
    """Nothing answered: no name resolution, no route, refused, or silence."""
    return isinstance(reason, (socket.gaierror, ConnectionRefusedError, TimeoutError, socket.timeout)) or (
        isinstance(reason, OSError) and reason.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ECONNREFUSED))


def _go_offline() -> None:
    """What `HF_HUB_OFFLINE=1` does, for the rest of this process (and the
    processes it starts): huggingface_hub read the variable when imported."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    _OFFLINE_DETECTED.append(True)


_OFFLINE_DETECTED: list[bool] = []


def offline_detected() -> bool:
    """This process found the Hub unreachable and went offline."""
    return bool(_OFFLINE_DETECTED)


def offline_note() -> str | None:
    """One sentence on why models come from the cache only, if they do."""
    if _OFFLINE_DETECTED:
        return "the Hugging Face Hub cannot be reached, so only models on this disk can be used"
    if offline_by_setting():
        return "offline mode is on (HF_HUB_OFFLINE=1), so only models on this disk can be used"
    return None


def is_hub_id(name: str) -> bool:
    """Spelled as the Hub allows ("org/name", no "--" or "..", no trailing dot)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def is_cached(hub_id: str) -> bool:
    """The model's config and weights are in the local Hugging Face cache."""
    from huggingface_hub import try_to_load_from_cache

    if not is_hub_id(hub_id):
        return False
    config = try_to_load_from_cache(hub_id, "config.json")
    if not isinstance(config, str):
        return False
    snapshot = Path(config).parent
    return any(snapshot.glob("*.safetensors")) or any(snapshot.glob("*.bin"))


def availability(name: str) -> str:
    """Where a model would load from: LOCAL, CACHED, DOWNLOADABLE or UNAVAILABLE.
    Asks the Hub only for a model that is on neither the disk nor the cache."""
    path = Path(name).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf"):
        return LOCAL
    if is_cached(name):
        return CACHED
    return DOWNLOADABLE if is_hub_id(name) and hub_reachable() else UNAVAILABLE


def usable_candidates(candidates: list[ModelChoice]) -> tuple[list[ModelChoice], str]:
    """The preset's models that can load here (all of them while the Hub answers),
    and what to add to the reason for the choice when some cannot."""
    where = {c.name: availability(c.name) for c in candidates}
    usable = [c for c in candidates if where[c.name] != UNAVAILABLE]
    note = offline_note()
    if note is None:
        return candidates, ""
    if not usable:
        return candidates, (f"; {note}, and none of the preset's models is in the local Hugging Face cache: "
                            "pass --model PATH to a local model directory")
    cached = ", ".join(c.name.split("/")[-1] for c in usable)
    return usable, f"; {note}: usable offline: {cached}"
