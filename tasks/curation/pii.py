"""PII scrubbing: e-mail addresses, IP addresses and phone numbers become placeholders."""

from __future__ import annotations

import ipaddress
import re

from llmflow.tasks.curation.config import PIIConfig

_EMAIL = re.compile(r"\b[\w.+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b")
_IPV4 = re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?![\d.]|\.\d)")
_IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{1,4}:){2,7}[0-9A-Fa-f]{1,4}(?![\w:])")
# NOTE: phone numbers need separators or a leading "+" so that years, ids and numbers inside
# prose ("1,234,567") are not scrubbed; a bare 10-digit run is left alone on purpose.
_PHONE = re.compile(
    r"(?<![\w+])(?:\+\d{1,3}[\s.-]?)?(?:\(\d{2,4}\)[\s.-]?|\d{2,4}[\s.-])\d{3,4}[\s.-]\d{3,4}(?![\w-])"
)


def _valid_ip(candidate: str) -> bool:
    try:
        ipaddress.ip_address(candidate)
    except ValueError:
        return False
    return True


def scrub_pii(cfg: PIIConfig, text: str) -> tuple[str, dict[str, int]]:
    """Replaces e-mails, IPs and phone numbers in `text`; returns the text and counts by kind."""
    counts = {"email": 0, "ip_address": 0, "phone": 0}
    if "@" in text:
        text, counts["email"] = _EMAIL.subn(cfg.email_placeholder, text)

    def _ip(match: re.Match) -> str:
        if not _valid_ip(match.group()):
            return match.group()
        counts["ip_address"] += 1
        return cfg.ip_placeholder

    text = _IPV4.sub(_ip, text)
    if ":" in text:
        text = _IPV6.sub(_ip, text)
    text, counts["phone"] = _PHONE.subn(cfg.phone_placeholder, text)
    return text, counts
