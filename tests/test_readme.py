"""The README's Python snippets run as written (in order, sharing one namespace)."""

import pathlib
import re

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # snippets that save files write them here
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python blocks"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    import shardops

    (c,) = shardops.collectives(
        namespace["mesh"], namespace["mlp"], *[namespace[k] for k in ("x", "p1", "p2")]
    )
    assert (c.kind, c.axes, c.bytes) == ("all-reduce", ("model",), 64 * 10 * 4)
    f = namespace["f"]
    x = namespace["x"]
    p1, p2 = namespace["p1"], namespace["p2"]
    assert f(x, p1["w"], p1["b"], p2["w"], p2["b"]).shape == (256, 10)
