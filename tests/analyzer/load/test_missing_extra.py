"""Model code that needs a package one of amp-autopsy's extras installs (torchao for an FP8 model) gets one
``Error:`` line naming the extra, whether the import fails when the module loads or when the factory runs."""
from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner

from analyzer.cli import main

_MODEL = """
    import torch
    {top}

    def build():
        {inner}
        torch.manual_seed(0)
        return torch.nn.Linear(4, 1)

    def loss(model, batch):
        return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
"""


@pytest.mark.parametrize("top, inner", [("import torchao.float8", "pass"), ("", "import torchao.float8")],
                         ids=["at import", "in the factory"])
def test_an_fp8_model_without_torchao_is_one_error_line_naming_the_fp8_extra(tmp_path, monkeypatch, top, inner):
    monkeypatch.setitem(sys.modules, "torchao", None)  # torchao absent, as without the [fp8] extra
    (tmp_path / "fp8model.py").write_text(textwrap.dedent(_MODEL.format(top=top, inner=inner)))
    torch.save(torch.nn.Linear(4, 1).state_dict(), tmp_path / "m.pt")
    torch.save({"x": torch.randn(2, 4), "y": torch.randn(2, 1)}, tmp_path / "b.pt")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["replay", "m.pt", "--batch", "b.pt", "--factory", "fp8model:build",
                                    "--loss-fn", "fp8model:loss", "--path", str(tmp_path)])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: "), res.output
    assert "from amp-autopsy's [fp8] extra: pip install 'amp-autopsy[fp8]'" in lines[0]
