"""Imported in the engine process (scenario key ``imports``): every step whose restores
``XKV_EARLY_ISSUE`` issued at scheduling prints ``EARLY_ISSUED_STEP <load job ids>`` on stdout,
so a test can count them against the steps with restores."""

from __future__ import annotations

from xkv.connector import early_issue

MARK = "EARLY_ISSUED_STEP"
_issued = early_issue.Handover.issued


def _marked(self, step):
    _issued(self, step)
    print(MARK, list(early_issue.key(step)), flush=True)


early_issue.Handover.issued = _marked
