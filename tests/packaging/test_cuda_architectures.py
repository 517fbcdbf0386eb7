"""The GPU code a source build compiles (cmake/attnmerge_cuda_architectures.cmake), by what the build
machine has and what the builder asks for: with no request, SASS for the GPUs nvidia-smi lists (and
the newest one's PTX from sm_90 on), PTX alone where it lists none; `release` the wheels' list; a
list in CMake's form as given.  The machine's GPUs are injected as a stand-in nvidia-smi; each case
runs the choice alone (cmake -P), and prints the line the build prints."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
MODULE = os.path.join(ROOT, "cmake", "attnmerge_cuda_architectures.cmake")
RELEASE = "75-real;80-real;86-real;89-real;90-real;100-real;120"
PTX_ALONE = "75-virtual;90-virtual"


def fake_nvidia_smi(tmp_path, caps=None, fails=None):
    """An nvidia-smi that lists GPUs of these compute capabilities ("9.0"), or fails as nvidia-smi
    does on a machine whose driver sees no GPU."""
    path = tmp_path / "nvidia-smi"
    if fails:
        path.write_text(f"#!/bin/sh\necho '{fails}'\nexit 6\n")
    else:
        path.write_text("#!/bin/sh\n" + "".join(f"echo '{c}'\n" for c in caps))
    path.chmod(0o755)
    return str(path)


def choose(tmp_path, smi, define=None, env=None, cmake_archs=None):
    """(CMAKE_CUDA_ARCHITECTURES, SASS, PTX, choice, the build's line) as the build would choose them."""
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("no cmake on PATH")
    if not os.path.isfile(MODULE):
        pytest.skip("not run from a source tree")
    driver = tmp_path / "choose.cmake"
    driver.write_text(f'include("{MODULE}")\nattnmerge_choose_cuda_architectures()\n'
                      'message("RESULT|${CMAKE_CUDA_ARCHITECTURES}|${ATTNMERGE_CUDA_SASS_ARCHS}|'
                      '${ATTNMERGE_CUDA_PTX_ARCHS}|${ATTNMERGE_CUDA_ARCHS_CHOICE}")\n')
    args = [cmake, f"-DATTNMERGE_NVIDIA_SMI={smi}"]
    if define is not None:
        args.append(f"-DATTNMERGE_CUDA_ARCHITECTURES={define}")
    if cmake_archs is not None:
        args.append(f"-DCMAKE_CUDA_ARCHITECTURES={cmake_archs}")
    environ = {k: v for k, v in os.environ.items() if k != "ATTNMERGE_CUDA_ARCHITECTURES"}
    environ.update(env or {})
    p = subprocess.run([*args, "-P", str(driver)], capture_output=True, text=True, env=environ, timeout=120)
    out = p.stdout + p.stderr
    if p.returncode != 0:
        return None, out
    (result,) = re.findall(r"^RESULT\|(.*)$", out, re.M)
    archs, sass, ptx, choice = result.split("|")
    (line,) = [line for line in out.splitlines() if line.startswith("-- attnmerge: GPU code")]
    return (archs, sass, ptx, choice, line), out


def test_the_gpus_of_the_machine_get_sass_and_the_newest_its_ptx(tmp_path):
    (archs, sass, ptx, choice, line), _ = choose(tmp_path, fake_nvidia_smi(tmp_path, ["9.0", "8.6", "9.0"]))
    assert (archs, sass, ptx, choice) == ("86-real;90", "86;90", "90", "detected")
    for word in ["SASS for sm_86 sm_90", "PTX compute_90", "the GPUs of this machine", "nvidia-smi found 3 GPU(s)"]:
        assert word in line, (word, line)


def test_gpus_before_sm_90_get_no_ptx_that_would_lack_the_sm_90_code(tmp_path):
    # compute_86's PTX, JIT-compiled on an sm_90 GPU, would be asked for programmatic dependent
    # launch without the kernels' wait for it: such a build carries SASS alone.
    (archs, sass, ptx, choice, line), _ = choose(tmp_path, fake_nvidia_smi(tmp_path, ["8.6", "8.0"]))
    assert (archs, sass, ptx, choice) == ("80-real;86-real", "80;86", "", "detected")
    assert "SASS for sm_80 sm_86, no PTX" in line, line


def test_a_gpu_older_than_the_oldest_supported_is_named_and_left_out(tmp_path):
    (archs, sass, ptx, choice, line), _ = choose(tmp_path, fake_nvidia_smi(tmp_path, ["7.0", "12.0"]))
    assert (archs, sass, ptx, choice) == ("120", "120", "120", "detected")
    assert "sm_70 older than sm_75" in line, line
    (archs, sass, ptx, choice, line), _ = choose(tmp_path, fake_nvidia_smi(tmp_path, ["7.0"]))
    assert (archs, ptx, choice) == (PTX_ALONE, "75;90", "no-gpu")


@pytest.mark.parametrize("machine", ["no driver's GPU", "no nvidia-smi"])
def test_no_gpu_found_builds_ptx_alone(tmp_path, machine):
    smi = (fake_nvidia_smi(tmp_path, fails="No devices were found") if machine == "no driver's GPU"
           else str(tmp_path / "absent" / "nvidia-smi"))
    (archs, sass, ptx, choice, line), _ = choose(tmp_path, smi)
    assert (archs, sass, ptx, choice) == (PTX_ALONE, "", "75;90", "no-gpu")
    for word in ["no SASS, PTX compute_75 compute_90", "no GPU found", "JIT", "ATTNMERGE_CUDA_ARCHITECTURES=release",
                 "No devices were found" if machine == "no driver's GPU" else "no nvidia-smi"]:
        assert word in line, (word, line)


@pytest.mark.parametrize("how", ["define", "env", "env, any case"])
def test_release_asks_for_the_wheels_list_whatever_the_machine_has(tmp_path, how):
    smi = fake_nvidia_smi(tmp_path, ["9.0"])
    kwargs = {"define": {"define": "release"}, "env": {"env": {"ATTNMERGE_CUDA_ARCHITECTURES": "release"}},
              "env, any case": {"env": {"ATTNMERGE_CUDA_ARCHITECTURES": " Release "}}}[how]
    (archs, sass, ptx, choice, line), _ = choose(tmp_path, smi, **kwargs)
    assert (archs, sass, ptx, choice) == (RELEASE, "75;80;86;89;90;100;120", "120", "release")
    assert "the release list" in line


@pytest.mark.parametrize("given,archs,sass,ptx", [
    ("90", "90", "90", "90"),
    ("80-real;90", "80-real;90", "80;90", "90"),
    ("80-real 90", "80-real;90", "80;90", "90"),
    ("86,89-real", "86;89-real", "86;89", "86"),
    ("75-virtual", "75-virtual", "", "75"),
])
def test_a_list_is_built_as_given(tmp_path, given, archs, sass, ptx):
    smi = fake_nvidia_smi(tmp_path, ["12.0"])
    for kwargs in ({"define": given}, {"env": {"ATTNMERGE_CUDA_ARCHITECTURES": given}}, {"cmake_archs": given}):
        result, out = choose(tmp_path, smi, **kwargs)
        assert result is not None, out
        assert result[:4] == (archs, sass, ptx, "requested"), (kwargs, result)


def test_the_define_comes_before_the_environment_and_auto_is_the_default_by_name(tmp_path):
    smi = fake_nvidia_smi(tmp_path, ["8.9"])
    result, _ = choose(tmp_path, smi, define="90", env={"ATTNMERGE_CUDA_ARCHITECTURES": "release"})
    assert result[:4] == ("90", "90", "90", "requested")
    result, _ = choose(tmp_path, smi, env={"ATTNMERGE_CUDA_ARCHITECTURES": "auto"})
    assert result[:4] == ("89-real", "89", "", "detected")


@pytest.mark.parametrize("given", ["native", "all", "sm_90", "90-reel"])
def test_anything_else_is_refused_in_one_line(tmp_path, given):
    result, out = choose(tmp_path, fake_nvidia_smi(tmp_path, ["9.0"]), define=given)
    assert result is None
    lines = [line.strip() for line in out.splitlines() if line.strip().startswith("attnmerge: ")]
    assert len(lines) == 1, out
    for word in ["ATTNMERGE_CUDA_ARCHITECTURES", "auto", "release", f"got '{given}'"]:
        assert word in lines[0], (word, lines[0])
