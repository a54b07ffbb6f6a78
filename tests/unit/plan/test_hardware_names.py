"""--hardware finds a preset by the names people use, and says did-you-mean for a near miss."""

import pytest

from partrain.errors import ConfigError
from partrain.plan.hardware import PRESETS, load_hardware


@pytest.mark.parametrize("name, preset", [
    ("h100", "H100-SXM"), ("H100", "H100-SXM"), ("h100-sxm", "H100-SXM"), ("H100 SXM5", "H100-SXM"),
    ("a100", "A100-80GB"), ("A100-80GB", "A100-80GB"), ("h200", "H200"), ("b200", "B200"),
    ("mi300x", "MI300X"), ("MI300X-OAM", "MI300X")])
def test_a_preset_by_its_common_name(name, preset):
    assert load_hardware(name) is PRESETS[preset]


@pytest.mark.parametrize("name, guess", [("h10", "H100-SXM"), ("mi300", "MI300X"),
                                         ("b20", "B200"), ("hundred", None)])
def test_a_near_miss_gets_a_did_you_mean(name, guess, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no file of that name here
    with pytest.raises(ConfigError) as err:
        load_hardware(name)
    message = str(err.value)
    assert message.startswith(f"--hardware {name}: neither a preset (A100-80GB, H100-SXM, H200, "
                              "B200, MI300X) nor a YAML file")
    assert (f"did you mean {guess}?" in message) if guess else ("did you mean" not in message)


def test_the_new_presets_carry_their_datasheets_figures():
    b200, mi300x = PRESETS["B200"], PRESETS["MI300X"]
    assert (b200.memory_gib, b200.peak_tflops, b200.intra_node_gbps) == (180, 2250, 900)
    assert (mi300x.memory_gib, mi300x.peak_tflops, mi300x.intra_node_gbps) == (192, 1307, 448)
    # Faster than an H100 on paper, each.
    assert min(b200.peak_flops, mi300x.peak_flops) > PRESETS["H100-SXM"].peak_flops
