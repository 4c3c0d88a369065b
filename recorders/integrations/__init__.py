"""Thin framework adapters over the Recorder: ``recorders.integrations.hf`` and ``.lightning``.

Nothing is imported here: ``import recorders`` (and this package) never loads transformers or
lightning. Import the adapter you need, which needs its extra installed::

    pip install 'amp-autopsy[hf]'         # then: from recorders.integrations.hf import AmpAutopsyCallback
    pip install 'amp-autopsy[lightning]'  # then: from recorders.integrations.lightning import AmpAutopsyCallback
"""
from __future__ import annotations

__all__: list[str] = []
