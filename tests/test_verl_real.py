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

import json  # noqa: E402
import uuid  # noqa: E402

import anyio  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import test_verl_export as base  # noqa: E402

REPO, TASK = base.REPO, base.TASK
server, exported, _token = base.server, base.exported, base._token  # the same export, on a real server
CONFIG_DIR = Path(verl.__file__).parent / "trainer" / "config"


@pytest.fixture(scope="module", autouse=True)
def _module_token(exported):
    """verl builds the tools (they read the token then) in module-scoped fixtures too: RLHFDataset loads
    them. After `exported`, which takes the variable away again."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_AGENT_MCP_TOKEN", base.TOKEN)
        yield


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


class Episodes:
    """verl's side of a rollout without an LLM: the Hermes parser reads a scripted model turn and
    ToolAgentLoop._call_tool runs its calls (create, execute, release) with one AgentData per episode."""

    def __init__(self, out: Path, tok, row: dict):
        from verl.experimental.agent_loop.tool_parser import ToolParser
        from verl.tools.tool_registry import load_all_tools

        self.tools = {t.name: t for t in load_all_tools(str(out / "tool_config.yaml"), None)}
        # the attributes _call_tool reads (ToolAgentLoop's constructor needs a rollout server)
        self.loop = SimpleNamespace(tools=self.tools, max_tool_response_length=16384,
                                    tool_response_truncate_side="middle")
        self.parser, self.tok, self.row = ToolParser.get_tool_parser("hermes", tok), tok, row

    def start(self, request_id: str):
        from verl.experimental.agent_loop.tool_agent_loop import AgentData

        return AgentData(messages=list(self.row["raw_prompt"]), image_data=None, video_data=None, audio_data=None,
                         mm_processor_kwargs=None, metrics={}, request_id=request_id,
                         tools_kwargs=self.row["tools_kwargs"])

    async def turn(self, agent, text: str) -> list[str]:
        from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

        schemas = [t.tool_schema for t in self.tools.values()]
        _, calls = await self.parser.extract_tool_calls(self.tok.encode(text), schemas)
        return [(await ToolAgentLoop._call_tool(self.loop, c, agent.tools_kwargs, agent))[0].text for c in calls]


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_verls_tool_loop_calls_our_tools_one_workspace_per_request(exported, dataset, tok, server):
    from harness.verl import WORKSPACE_FIELD

    out, _ = exported
    episodes = Episodes(out, tok, dataset[0])
    read = call("read_file", path="kernels/a.cpp")

    async def go() -> tuple[list[str], ...]:
        a, b = episodes.start("req-a"), episodes.start("req-b")
        wrote = await episodes.turn(a, "I will write it.\n" + call("write_file", path="kernels/a.cpp",
                                                                      content="// one\n"))
        return a, wrote, await episodes.turn(a, read), await episodes.turn(b, read), await episodes.turn(
            a, call("read_file", file="kernels/a.cpp"))

    a, wrote, mine, other, bad = anyio.run(go)
    assert len(wrote) == 1 and "error" not in wrote[0].lower(), wrote
    assert "// one" in mine[0] and "// one" not in other[0]
    assert "error" in bad[0].lower() and "path" in bad[0], bad
    sessions = episodes.tools["read_file"].sessions
    assert {"req-a", "req-b"} <= set(sessions.open) and sessions.open["req-a"][1] != sessions.open["req-b"][1]
    # the reward finds the episode's workspace where verl forwards it: the episode's extra_fields
    assert a.extra_fields[WORKSPACE_FIELD] == {"url": server, "workspace_id": sessions.open["req-a"][1]}
    assert all(not t.tasks for t in episodes.tools.values())  # verl released every instance it created


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


def _sample(tok, response: str, row: dict, tool_fields: dict | None = None):
    """One rollout sample as verl's agent loop hands it to the reward loop (agent_loop.py: prompts,
    responses, attention_mask; the row's columns; the episode's extra_fields as tool_extra_fields)."""
    from verl import DataProto

    prompt = tok.encode(tok.apply_chat_template(row["raw_prompt"], add_generation_prompt=True, tokenize=False))
    resp = tok.encode(response)
    non_tensors = {"data_source": np.array([row["data_source"]], dtype=object),
                   "reward_model": np.array([row["reward_model"]], dtype=object),
                   "extra_info": np.array([dict(row["extra_info"])], dtype=object)}
    if tool_fields is not None:
        non_tensors["tool_extra_fields"] = np.array([tool_fields], dtype=object)
    return DataProto.from_dict(
        tensors={"prompts": torch.tensor([prompt]), "responses": torch.tensor([resp]),
                 "attention_mask": torch.ones(1, len(prompt) + len(resp), dtype=torch.int64)},
        non_tensors=non_tensors)


@pytest.fixture(scope="module")
def reward_config(exported):
    from verl.trainer.ppo.reward import get_custom_reward_fn

    out, _ = exported
    config = compose_ppo(documented_overrides(reward__custom_reward_function__path=str(out / "reward.py")))
    assert get_custom_reward_fn(config) is not None
    return config


async def score(config, tok, sample) -> dict:
    from verl.trainer.ppo.reward import load_reward_manager

    manager = load_reward_manager(config, tok)  # in the running loop, as verl's reward worker builds it
    result = await manager.run_single(sample)
    return {"score": result["reward_score"], **result["reward_extra_info"]}


def test_verls_reward_manager_rebuilds_from_the_response_when_no_episode_workspace(reward_config, dataset, tok):
    row = dataset[0]
    # a model turn as verl's reward manager decodes it: skip_special_tokens drops <tool_call> and the
    # chat markers where the tokenizer marks them special (this one does; Qwen's leaves the tool tags)
    written = (call("write_file", path="model_new.py", content="this is not python") + "<|im_end|>\n"
               "<|im_start|>user\n<tool_response>\nwrote</tool_response><|im_end|>\n<|im_start|>assistant\nDone.")
    nothing = anyio.run(score, reward_config, tok, _sample(tok, "I think it is done.<|im_end|>", row))
    assert nothing["score"] == -1.0 and nothing["workspace"] == "rebuilt" and nothing["file_calls_applied"] == 0
    broken = anyio.run(score, reward_config, tok, _sample(tok, written, row))
    assert broken["workspace"] == "rebuilt" and broken["file_calls_applied"] == 1, broken  # reached the judge
    assert broken["score"] == -1.0 and broken["milestone"] == "failed"


def _episode_then_reward(exported, dataset, tok, reward_config, files: dict[str, str]) -> tuple[dict, list[str]]:
    out, _ = exported
    row = dataset[0]
    episodes = Episodes(out, tok, row)

    async def go() -> tuple[dict, list[str]]:
        agent = episodes.start(uuid.uuid4().hex)  # verl's request ids are fresh per episode
        text = "".join(call("write_file", path=p, content=c) for p, c in files.items())
        wrote = await episodes.turn(agent, text)
        assert len(wrote) == len(files) and all(r.startswith(("wrote", "created")) for r in wrote), wrote
        # the response text carries no file calls: only the episode's workspace can score it
        result = await score(reward_config, tok, _sample(tok, "Done.", row, dict(agent.extra_fields)))
        return result, await episodes.turn(agent, call("list_files"))

    return anyio.run(go)


def test_verls_reward_manager_judges_and_closes_the_episode_workspace(exported, dataset, tok, reward_config):
    result, after = _episode_then_reward(exported, dataset, tok, reward_config,
                                         {"model_new.py": "this is not python"})
    assert result["workspace"] == "episode" and result["file_calls_applied"] == 0
    assert result["score"] == -1.0 and result["milestone"] == "failed", result
    assert "error" in after[0].lower()  # the reward gave the workspace back


@pytest.mark.full  # builds the CPU extension; verl's side: the tests above
@pytest.mark.slow  # builds the CPU extension (about 40 s)
def test_a_correct_episode_scores_through_verls_tool_loop_and_reward_manager(exported, dataset, tok,
                                                                             reward_config):
    fixture = REPO / "tests" / "fixtures" / "cpu_multi"
    files = {"kernels/variants.cpp": (fixture / "kernels" / "variants.cpp").read_text(),
             "model_new.py": (fixture / "model_new.py").read_text().replace("VARIANT", "correct")}
    result, _ = _episode_then_reward(exported, dataset, tok, reward_config, files)
    assert result["workspace"] == "episode" and result["milestone"] != "failed" and result["score"] > 0, result


def test_verls_agent_loop_runs_a_scripted_episode_and_its_reward_judges_it(exported, dataset, tok, reward_config):
    """verl's whole ToolAgentLoop.run (prompt tokens, generation, Hermes parsing, tool calls, tool
    messages through the chat template, extra_fields) with a scripted LLM in place of vLLM."""
    from omegaconf import open_dict
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
    from verl.tools.tool_registry import load_all_tools
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.workers.rollout.replica import TokenOutput

    from harness.verl import WORKSPACE_FIELD

    out, _ = exported
    row = dataset[0]
    turns = [call("write_file", path="model_new.py", content="this is not python") + "<|im_end|>",
             call("read_file", path="model_new.py") + "<|im_end|>", "Done.<|im_end|>"]
    prompts: list[str] = []

    class ScriptedLLM:  # verl's server manager interface: generate(request_id, prompt_ids, sampling_params)
        async def generate(self, request_id, prompt_ids, sampling_params, **_):
            prompts.append(tok.decode(prompt_ids))
            return TokenOutput(token_ids=tok.encode(turns[len(prompts) - 1]), stop_reason="completed")

    config = reward_config.copy()
    with open_dict(config):
        config.actor_rollout_ref.rollout.prompt_length = 100_000
    tools = ToolListWrap(load_all_tools(str(out / "tool_config.yaml"), None))

    async def go():
        # built in the running loop, as verl's agent loop worker builds it (it keeps that loop)
        loop = ToolAgentLoop(trainer_config=DictConfigWrap(config), server_manager=ScriptedLLM(), tokenizer=tok,
                             processor=None, dataset_cls=RLHFDataset, data_config=DictConfigWrap(config.data),
                             tools=tools)
        output = await loop.run({"temperature": 1.0}, raw_prompt=row["raw_prompt"], tools_kwargs=row["tools_kwargs"],
                                extra_info=row["extra_info"])
        response = tok.decode(output.response_ids, skip_special_tokens=True)
        return output, await score(reward_config, tok, _sample(tok, response, row, dict(output.extra_fields)))

    output, result = anyio.run(go)
    assert len(prompts) == 3 and "this is not python" in prompts[2]  # the tool's reply reached the model
    assert "<tools>" in prompts[0] and '"name": "edit_file"' in prompts[0]  # the tool schemas were rendered
    assert "error" not in prompts[1][prompts[1].rindex("<tool_response>"):], prompts[1][-1000:]
    assert WORKSPACE_FIELD in output.extra_fields, output.extra_fields
    assert result["workspace"] == "episode" and result["milestone"] == "failed" and result["score"] == -1.0, result
