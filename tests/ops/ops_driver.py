"""Child process of test_operator_engine.py: one CPU engine with FusIOnXConnector, vLLM's own KV
events and its Prometheus metrics; stores a prompt, drops vLLM's prefix cache, restores it,
then runs a second prompt (which makes a small card evict the first).

    python ops_driver.py SCENARIO.json RESULT.json
"""

from __future__ import annotations

import json
import os
import sys


def main(scenario_path: str, result_path: str) -> None:
    with open(scenario_path) as f:
        sc = json.load(f)
    import prometheus_client
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig

    llm = LLM(
        model=sc["model"], dtype="float32", block_size=sc["block_size"], max_model_len=1024,
        enable_prefix_caching=True, enforce_eager=True, seed=0, disable_log_stats=False,
        # vLLM's own events (the GPU tier), to compare block hashes with the gateway's
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                        endpoint=f"tcp://127.0.0.1:{sc['vllm_events_port']}"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="FusIOnXConnector",
            kv_connector_module_path="xkv_vllm_connector.fusionx_connector",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"xkv_gateway_port": sc["port"],
                                       "chunk_size": sc["chunk_size"],
                                       "lookup_timeout_ms": 2000}),
    )
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = {"prompt_token_ids": sc["tokens"]}
    res = {"runs": []}
    for i in range(2):
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        res["runs"].append({"cached": out.num_cached_tokens,
                            "tokens": list(out.outputs[0].token_ids)})
        if i == 0:
            llm.reset_prefix_cache()
    if sc.get("second_tokens"):  # another prompt, to make the card evict the first one
        out = llm.generate([{"prompt_token_ids": sc["second_tokens"]}], sp, use_tqdm=False)[0]
        res["runs"].append({"cached": out.num_cached_tokens,
                            "tokens": list(out.outputs[0].token_ids)})
    res["prometheus"] = prometheus_client.generate_latest().decode()
    with open(result_path, "w") as f:
        json.dump(res, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
