"""The exported verl setup read and driven by verl's own code (the `verl` extra; skipped without it):
verl's tool registry builds our tools from tool_config.yaml, verl's RLHFDataset reads our parquet,
verl's Hermes parser and tool loop call our tools through create/execute/release against a real
`cuda-agent serve --transport http` on loopback, the documented `main_ppo` command composes and
validates with verl's Hydra config, and verl's reward loader and reward manager score a response
with the exported reward.py. The tokenizer is a tiny byte-level BPE trained here (no model hub)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

verl = pytest.importorskip("verl", reason="the verl extra is not installed")
pytest.importorskip("transformers", reason="the train extra is not installed")

import anyio  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from test_verl_export import REPO, TASK, TOKEN, _token, exported, server  # noqa: E402,F401

CONFIG_DIR = Path(verl.__file__).parent / "trainer" / "config"


@pytest.fixture(scope="module")
def tok():
    from training.models import train_tokenizer

    return train_tokenizer(600, files=[REPO / "skills" / "SKILL.md", TASK])


@pytest.fixture(scope="module")
def model_dir(tok, tmp_path_factory) -> Path:
    """A model folder verl's model config accepts: the tokenizer and a one-layer Qwen3 config."""
    from transformers import Qwen3Config

    out = tmp_path_factory.mktemp("verl-model")
    tok.save_pretrained(out)
    Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                architectures=["Qwen3ForCausalLM"]).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dataset(exported, tok, tmp_path_factory):
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    out, _ = exported
    config = OmegaConf.create({"cache_dir": str(tmp_path_factory.mktemp("verl-cache")), "max_prompt_length": 100_000,
                               "tool_config_path": str(out / "tool_config.yaml"), "return_raw_chat": True})
    return RLHFDataset(str(out / "train.parquet"), tok, config)


def documented_overrides(**replace: str) -> list[str]:
    """The Hydra overrides of the `main_ppo` command in docs/training.md, as the shell splits them;
    `replace` swaps the values of the keys it names (dots as double underscores)."""
    text = (REPO / "docs" / "training.md").read_text()
    block = re.search(r"python3 -m verl\.trainer\.main_ppo(.*?)\n```", text, re.S)
    assert block, "docs/training.md lost its verl command"
    overrides = shlex.split(block.group(1).replace("\\\n", " "))
    swap = {k.replace("__", "."): v for k, v in replace.items()}
    assert set(swap) <= {o.split("=", 1)[0] for o in overrides}, "the documented command lost a key"
    return [f"{k}={swap[k]}" if k in swap else o for o in overrides for k in [o.split("=", 1)[0]]]


def compose_ppo(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def test_verls_registry_builds_our_tools_with_the_exported_schemas(exported, server):
    import yaml
    from verl.tools.base_tool import BaseTool
    from verl.tools.tool_registry import load_all_tools

    from harness.verl_tool import CudaAgentTool

    out, summary = exported
    tools = load_all_tools(str(out / "tool_config.yaml"), None)
    assert [t.name for t in tools] == summary["tools"]
    assert all(isinstance(t, CudaAgentTool) and isinstance(t, BaseTool) for t in tools)
    exported_schemas = [t["tool_schema"] for t in yaml.safe_load((out / "tool_config.yaml").read_text())["tools"]]
    # what verl's tool loop hands the chat template is exactly what the export wrote
    assert [t.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for t in tools] == exported_schemas
    assert not any("workspace_id" in t.tool_schema.function.parameters.properties for t in tools)
    assert len({id(t.sessions) for t in tools}) == 1 and tools[0].sessions.urls == [server]


def test_verls_dataset_reads_the_parquet_with_the_tool_schemas(dataset, exported):
    _, summary = exported
    assert len(dataset) == 1  # a prompt the chat template could not render would be filtered out
    assert [s["function"]["name"] for s in dataset.tool_schemas] == summary["tools"]
    item = dataset[0]
    assert item["data_source"] == "cuda_agent" and item["agent_name"] == "tool_agent"
    assert [m["role"] for m in item["raw_prompt"]] == ["system", "user"]
    assert set(item["tools_kwargs"]) == set(summary["tools"])
    assert item["tools_kwargs"]["write_file"]["create_kwargs"]["task_source"] == TASK.read_text()


def test_verls_tool_loop_calls_our_tools_one_workspace_per_request(exported, dataset, tok):
    from verl.experimental.agent_loop.tool_agent_loop import AgentData, ToolAgentLoop
    from verl.experimental.agent_loop.tool_parser import ToolParser
    from verl.tools.tool_registry import load_all_tools

    out, _ = exported
    tools = {t.name: t for t in load_all_tools(str(out / "tool_config.yaml"), None)}
    # the attributes ToolAgentLoop._call_tool reads (its constructor needs a rollout server)
    loop = SimpleNamespace(tools=tools, max_tool_response_length=16384, tool_response_truncate_side="middle")
    parser = ToolParser.get_tool_parser("hermes", tok)
    item = dataset[0]

    def episode(request_id: str) -> AgentData:
        return AgentData(messages=list(item["raw_prompt"]), image_data=None, video_data=None, audio_data=None,
                         mm_processor_kwargs=None, metrics={}, request_id=request_id,
                         tools_kwargs=item["tools_kwargs"])

    async def turn(agent: AgentData, text: str) -> list[str]:
        _, calls = await parser.extract_tool_calls(tok.encode(text), [t.tool_schema for t in tools.values()])
        results = [await ToolAgentLoop._call_tool(loop, c, agent.tools_kwargs, agent) for c in calls]
        return [r[0].text for r in results]

    write = ('I will write it.\n<tool_call>\n{"name": "write_file", "arguments": {"path": "kernels/a.cpp", '
             '"content": "// one\\n"}}\n</tool_call>')
    read = '<tool_call>\n{"name": "read_file", "arguments": {"path": "kernels/a.cpp"}}\n</tool_call>'

    async def go() -> tuple[list[str], ...]:
        a, b = episode("req-a"), episode("req-b")
        wrote = await turn(a, write)
        return wrote, await turn(a, read), await turn(b, read), await turn(a, read.replace('"path"', '"file"'))

    wrote, mine, other, bad = anyio.run(go)
    assert len(wrote) == 1 and "error" not in wrote[0].lower(), wrote
    assert "// one" in mine[0] and "// one" not in other[0]
    assert "error" in bad[0].lower() and "path" in bad[0], bad
    sessions = tools["read_file"].sessions
    assert {"req-a", "req-b"} <= set(sessions.open) and sessions.open["req-a"][1] != sessions.open["req-b"][1]
    assert all(not t.tasks for t in tools.values())  # verl released every instance it created


def test_the_documented_main_ppo_command_composes_and_validates_in_verl(model_dir):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    # an unknown or misspelled key fails to compose; validation builds the model configs (hence a real folder)
    config = compose_ppo(documented_overrides(actor_rollout_ref__model__path=str(model_dir),
                                              critic__model__path=str(model_dir)))
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    assert multi_turn.enable and multi_turn.format == "hermes"
    assert multi_turn.tool_config_path == "verl/tool_config.yaml" and multi_turn.max_tool_response_length >= 16384
    # where verl 0.9's reward loader looks (the top-level `custom_reward_function` is no longer read)
    assert config.reward.custom_reward_function.path == "verl/reward.py"
    assert config.reward.custom_reward_function.name == "compute_score"


def _sample(tok, response: str, row: dict):
    """One rollout sample as verl's agent loop hands it to the reward manager."""
    from verl import DataProto

    prompt = tok.encode(tok.apply_chat_template(row["raw_prompt"], add_generation_prompt=True, tokenize=False))
    resp = tok.encode(response)
    return DataProto.from_dict(
        tensors={"prompts": torch.tensor([prompt]), "responses": torch.tensor([resp]),
                 "attention_mask": torch.ones(1, len(prompt) + len(resp), dtype=torch.int64)},
        non_tensors={"data_source": np.array([row["data_source"]], dtype=object),
                     "reward_model": np.array([row["reward_model"]], dtype=object),
                     "extra_info": np.array([dict(row["extra_info"])], dtype=object)})


def test_verls_reward_manager_scores_with_the_exported_reward_module(exported, dataset, tok):
    from verl.trainer.ppo.reward import get_custom_reward_fn, load_reward_manager

    out, _ = exported
    config = compose_ppo(documented_overrides(reward__custom_reward_function__path=str(out / "reward.py")))
    assert get_custom_reward_fn(config) is not None
    row = dataset[0]
    # the model's turn as verl's tool loop leaves it (special tokens are dropped when verl decodes it)
    written = ('<tool_call>\n{"name": "write_file", "arguments": {"path": "model_new.py", "content": '
               '"this is not python"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nwrote '
               '</tool_response><|im_end|>\n<|im_start|>assistant\nDone.<|im_end|>')

    async def score(response: str) -> dict:
        manager = load_reward_manager(config, tok)  # in the running loop, as verl's reward worker builds it
        return await manager.run_single(_sample(tok, response, row))

    nothing, broken = anyio.run(score, "I think it is done.<|im_end|>"), anyio.run(score, written)
    assert nothing["reward_score"] == -1.0 and nothing["reward_extra_info"]["file_calls_applied"] == 0
    info = broken["reward_extra_info"]
    assert info["file_calls_applied"] == 1, info  # the write survived verl's decoding and reached the judge
    assert broken["reward_score"] == -1.0 and info["milestone"] == "failed"
