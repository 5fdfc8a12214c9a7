from sandbox.correctness.selfcheck import self_verify
from tasks import load_task


def test_reference_passes_against_itself(small_task_path):
    r = self_verify(load_task(str(small_task_path)), "cpu", trials=1)
    assert r.ok, r.message


def test_nondeterministic_reference_is_flagged(tmp_path):
    f = tmp_path / "dropout_task.py"
    f.write_text("import torch\nclass Model(torch.nn.Module):\n"
                 "    def forward(self, x):\n        return torch.nn.functional.dropout(x, 0.5, training=True)\n"
                 "def get_inputs():\n    return [torch.rand(32, 32)]\ndef get_init_inputs():\n    return []\n")
    r = self_verify(load_task(str(f)), "cpu", trials=1)
    assert not r.ok and r.reason == "nondeterministic_reference"
