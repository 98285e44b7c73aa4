"""Pull a final answer out of a completion that wraps it in ``<tag>...</tag>``."""

from __future__ import annotations

import re
from functools import cache


@cache
def _tag_pattern(tag: str) -> re.Pattern[str]:
    return re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL | re.IGNORECASE)


def last_tagged(text: str, tag: str) -> str | None:
    """The stripped content of the last ``<tag>...</tag>`` block in ``text``; None when there is none or it is blank.

    The last block counts because models often restate a draft before the final answer.
    """
    blocks = _tag_pattern(tag).findall(text)
    if not blocks:
        return None
    content = blocks[-1].strip()
    return content or None
