"""The wheel users install holds every module and data file of the source tree, and declares the
tested version ranges (an editable install hides a package left out of the wheel)."""

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> where it lands in the wheel (pyproject's package-dir).
SOURCES = {"locks_hf": "locks_hf", "kernels": "locks_hf/kernels", "eval": "locks_hf/eval"}

# scripts/check_versions.sh runs the suite beside an installed wheel, without the sources to compare.
pytestmark = pytest.mark.skipif(
    not (ROOT / "locks_hf" / "__init__.py").is_file(),
    reason="checks a source tree against its wheel; this copy of the tests has no sources",
)


def _source_files() -> set[str]:
    """Wheel paths of every module and packaged data file of the source tree."""
    want = set()
    for folder, target in SOURCES.items():
        base = ROOT / folder
        for path in base.rglob("*"):
            rel = path.relative_to(base)
            # A dev tree may link locks_hf/kernels -> ../kernels; those files are counted under kernels/.
            if folder == "locks_hf" and rel.parts[0] in ("kernels", "eval"):
                continue
            if "__pycache__" in rel.parts or not path.is_file():
                continue
            if path.suffix == ".py" or (folder == "locks_hf" and rel.parts[0] == "data"):
                want.add(f"{target}/{rel.as_posix()}")
    return want


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        text=True,
    )
    (path,) = out.glob("locks_hf-*.whl")
    return zipfile.ZipFile(path)


def test_every_package_is_listed_in_pyproject():
    # (a regex, not tomllib: the compatibility checks collect this file on Python 3.10 too)
    line = re.search(r"^packages = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    listed = set(re.findall(r'"([\w.]+)"', line))
    found = set()
    for folder, target in SOURCES.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if folder == "locks_hf" and rel.parts and rel.parts[0] in ("kernels", "eval"):
                continue
            found.add(".".join((target.replace("/", "."), *rel.parts)))
    assert found == listed, (
        f"pyproject.toml [tool.setuptools] packages: add {sorted(found - listed)}, remove {sorted(listed - found)}"
    )


def test_wheel_holds_every_module_and_data_file(wheel):
    names = set(wheel.namelist())
    missing = sorted(_source_files() - names)
    assert not missing, f"the wheel lacks {missing}"
    assert "locks_hf/baselines/rocketkv.py" in names  # the package whose absence broke `import locks_hf`


def test_wheel_declares_the_tested_ranges(wheel):
    (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    text = wheel.read(meta).decode()
    requires = dict(re.findall(r"^Requires-Dist: ([A-Za-z0-9_.-]+)\s*\(?([^;\n]*?)\)?$", text, re.M))
    assert requires["transformers"].replace(" ", "") in (">=5.17,<5.26", "<5.26,>=5.17")
    assert requires["torch"].replace(" ", "").startswith(">=")
    assert re.search(r"^Requires-Python: >=3\.10", text, re.M)
    versions = re.findall(r"^Classifier: Programming Language :: Python :: (3\.\d+)$", text, re.M)
    assert versions == ["3.10", "3.11", "3.12", "3.13"]


def _import_from_the_root(code: str, extra_path: Path | None, *flags: str) -> subprocess.CompletedProcess:
    """Runs ``code`` with the source tree's root first on sys.path, as a shell or notebook started there has it."""
    path = [str(ROOT)] + ([str(extra_path)] if extra_path else [])
    prelude = f"import sys; sys.path[:0] = {path!r}; "
    return subprocess.run([sys.executable, *flags, "-c", prelude + code], cwd=ROOT, capture_output=True, text=True)


def test_the_kernel_sources_do_not_shadow_an_installed_kernels_package(tmp_path):
    """transformers >= 5.25 imports Hugging Face's ``kernels``: from the root, ``import kernels`` must find it,
    not this tree's ``kernels/`` folder, and ``locks_hf.kernels`` stays this tree's."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("from .layer import MARK\n")
    (tmp_path / "kernels" / "layer.py").write_text("MARK = 'installed'\n")
    done = _import_from_the_root(
        "import kernels.layer; from kernels import MARK; print(MARK, kernels.__file__)", tmp_path
    )
    assert done.returncode == 0, done.stderr
    mark, theirs = done.stdout.split()
    assert mark == "installed" and Path(theirs).parent == tmp_path / "kernels"
    # the same with this interpreter's packages: transformers (which may import `kernels` itself), then ours
    code = (
        "from transformers import AttentionInterface; import locks_hf.kernels as ours; print(ours.__name__, ours.__file__)\n"
        "try:\n    import kernels; print(kernels.__file__)\nexcept ImportError:\n    print('-')"
    )
    done = _import_from_the_root(code, None)
    assert done.returncode == 0, done.stderr
    name, ours, theirs = done.stdout.split()
    assert name == "locks_hf.kernels" and Path(ours).parent == ROOT / "kernels"
    assert theirs == "-" or ROOT not in Path(theirs).parents


def test_the_kernel_sources_imported_as_kernels_without_an_installed_one_stand_in_as_not_installed():
    """Without Hugging Face's ``kernels`` installed, ``import kernels`` from the root gets an empty module that
    names this tree's folder on any attribute, and no file or version: what transformers reads as not installed."""
    code = (
        "import kernels; print(getattr(kernels, '__version__', 'N/A'), getattr(kernels, '__file__', None))\n"
        "try:\n    kernels.get_kernel\nexcept AttributeError as e:\n    print('|', e)"
    )
    done = _import_from_the_root(code, None, "-S")  # -S: no site-packages, so no installed `kernels`
    assert done.returncode == 0, done.stderr
    head, message = done.stdout.split("|")
    assert head.split() == ["N/A", "None"]
    assert "locks_hf.kernels" in message and "get_kernel" in message


def test_transformers_imports_from_the_root_without_an_installed_kernels_package(tmp_path):
    """transformers before 5.25 does not need ``kernels`` but imports it when the name resolves (the source
    tree's folder does, from the root): with this interpreter's packages less ``kernels``, transformers,
    its attention interface and locks_hf import from the root, and transformers finds no hub kernels."""
    import transformers

    site = Path(transformers.__file__).resolve().parents[1]
    packages = tmp_path / "site"
    packages.mkdir()
    for entry in site.iterdir():
        if entry.name == "kernels" or (entry.name.startswith("kernels-") and entry.name.endswith(".dist-info")):
            continue
        (packages / entry.name).symlink_to(entry)
    code = (
        "from transformers.utils.import_utils import is_kernels_available\n"
        "from transformers import AttentionInterface, AutoModelForCausalLM\n"
        "import locks_hf\n"
        "print(is_kernels_available(), locks_hf.__name__)"
    )
    done = _import_from_the_root(code, packages, "-S")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "locks_hf"]
