"""Every Python snippet in docs/*.md runs, as a reader would run it, and prints what the text around it
says it prints: the learner's path (docs/emulator-tutorial.md) cannot rot unseen when kernels.py changes."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SNIPPET = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)

# What each snippet prints that its text promises, by (file, snippet number in the file): every Python
# snippet in docs/ is listed here, so a new one needs its promise written down (test_every_snippet_is_listed).
PROMISES = {
    ("emulator-tutorial.md", 0): ["ndarray (128, 512) float32 True"],
    ("emulator-tutorial.md", 1): ["refused: ndarray: partition dim 256 exceeds the 128 partitions", "True",
                                  "{'dma_copy': 2, 'activation_reduce': 1}"],
    ("emulator-tutorial.md", 2): ["refused:", "list comprehension", "True"],
    ("emulator-tutorial.md", 3): ["True\nTrue\n", "'dma_copy': 6"],
    ("emulator-tutorial.md", 4): ["torch.Size([1, 2, 512, 64]) torch.Size([1, 2, 128, 4]) True", "'tensor':"],
    ("emulator-tutorial.md", 5): ["as_written: overlap bound 15.9 us, scheduled 28.8 us, serial bound 55.4 us",
                                  "one_block_groups: overlap bound 18.5 us, scheduled 58.4 us, serial bound 58.6 us"],
    ("troubleshooting.md", 0): [],  # True True or False False, by the CPU: the snippet shows the bug where it is
}


def snippets():
    """(file name, number in the file, source) of every ```python block in docs/*.md."""
    found = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        for number, match in enumerate(SNIPPET.finditer(path.read_text())):
            found.append((path.name, number, match[1]))
    return found


def test_every_snippet_is_listed():
    assert sorted((name, number) for name, number, _ in snippets()) == sorted(PROMISES)


@pytest.mark.parametrize("name,number,source", snippets(), ids=lambda value: str(value)[:24])
def test_snippet_runs_and_prints_what_the_docs_say(tmp_path, name, number, source):
    """Saved as a file and run as the tutorial says (its own directory: what it writes stays out of the
    repository; the repository on the path, as running from its root puts it)."""
    script = tmp_path / "snippet.py"
    script.write_text(source)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for promise in PROMISES[(name, number)]:
        assert promise in proc.stdout, (promise, proc.stdout)
    if name == "troubleshooting.md":
        assert proc.stdout.split() in (["True", "True"], ["False", "False"]), proc.stdout


def test_the_tutorial_names_only_what_kernels_py_has():
    """The names it sends a reader to (`_private`, `*_kernel` and class names in backticks) and the section
    headings it quotes exist: a rename in kernels.py fails here until the tutorial follows."""
    import kernels
    import nki_emulator

    text = (ROOT / "docs" / "emulator-tutorial.md").read_text()
    names = set(re.findall(r"`(_[A-Za-z0-9_]+|[a-z_0-9]+_kernel|[A-Z][a-z]+[A-Z][A-Za-z]+)`", text))
    assert {"_limits_and_mask", "_pipeline", "flash_attention_bwd_kernel", "FwdQueryTile"} <= names
    missing = [name for name in sorted(names) if not hasattr(kernels, name) and not hasattr(nki_emulator, name)]
    assert not missing, f"docs/emulator-tutorial.md names what kernels.py does not have: {missing}"
    source = " ".join((ROOT / "kernels.py").read_text().split())
    for heading in re.findall(r'the section is headed "([^"]+)"', text):
        assert "# " + " ".join(heading.split()) in source, heading


def test_readme_what_is_where_names_every_file():
    """README's "what is where" names every program, kit file, emulator module, test file and doc, by its file
    name in backticks or its path: a file added without its line fails here (nki_emulator's package file aside)."""
    readme = (ROOT / "README.md").read_text()
    files = [path for pattern in ("*.py", "kit/*.py", "nki_emulator/*.py", "tests/*.py", "docs/*.md")
             for path in ROOT.glob(pattern)]
    named = [path for path in files if path.name != "__init__.py" or path.parent.name == "kit"]
    missing = sorted(str(path.relative_to(ROOT)) for path in named
                     if f"`{path.name}`" not in readme and f"{path.parent.name}/{path.name}" not in readme)
    assert len(files) > 60 and not missing, f"README.md's what is where does not name: {missing}"
