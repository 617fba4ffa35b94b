"""scripts/import_audit.py finds a circle that only ``if TYPE_CHECKING:`` imports hold, on a tree made for it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PLAN = """from __future__ import annotations
from smsdp.planner.render import table
class Plan:
    def __str__(self) -> str:
        return table(self)
"""
RENDER_HELD = """from __future__ import annotations
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from smsdp.planner.plan import Plan
else:
    import json
def table(plan: Plan) -> str:
    return json.dumps(str(type(plan)))
"""


def audit(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "import_audit.py"), "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def make_tree(root: Path, render: str) -> None:
    planner = root / "smsdp" / "planner"
    planner.mkdir(parents=True)
    for init in (root / "smsdp" / "__init__.py", planner / "__init__.py"):
        init.write_text("")
    (planner / "plan.py").write_text(PLAN)
    (planner / "render.py").write_text(render)


def test_a_circle_held_by_type_checking_imports_is_found(tmp_path):
    make_tree(tmp_path, RENDER_HELD)
    result = audit(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "smsdp.planner.plan <-> smsdp.planner.render (held by TYPE_CHECKING imports)" in result.stdout


def test_without_the_annotation_import_there_is_no_circle(tmp_path):
    make_tree(tmp_path, RENDER_HELD.replace("    from smsdp.planner.plan import Plan\n", "    Plan = object\n"))
    result = audit(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "circles: 0" in result.stdout
