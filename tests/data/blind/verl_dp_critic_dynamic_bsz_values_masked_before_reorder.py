"""verl PPO critic with dynamic batch size: the response mask is applied to the values before they are put back in order.

Citation: verl-project/verl#1440, commit f147ede20 ("[BUG] fix value mask bug in dp_critic"),
verl/workers/critic/dp_critic.py DataParallelPPOCritic.compute_values. Bug state read at f147ede20^ together with
verl/utils/seqlen_balancing.py (karmarkar_karp, get_seqlen_balanced_partitions, rearrange_micro_batches,
get_reverse_idx), verl/utils/model.py (compute_position_id_with_mask) and verl/trainer/ppo/core_algos.py
(compute_gae_advantage_return).

Bug: with critic.use_dynamic_bsz the batch is split into token-balanced micro-batches by rearrange_micro_batches,
so the rows come back from the critic in partition order. compute_values multiplied the values by the response
slice of the attention mask (`attention_mask[:, -response_length - 1 : -1]`) while they were still in that order,
and only then reverted the permutation: each row's values were masked with another row's response mask, keeping
the value head's outputs over one sample's padding and zeroing real response steps of another.

Fix: revert the permutation first, then multiply by the mask.

This program: a rollout batch of left-padded prompts and right-padded responses, the critic (a tiny
Qwen2ForTokenClassification with num_labels=1, as verl builds it from AutoModelForTokenClassification) run without
remove-padding, compute_values with dynamic batch size, then GAE from a score on each response's last token.
TensorDict / DataProto / the OmegaConf config are replaced by small stand-ins; the distributed paths are dropped.
"""
import copy
import heapq
import itertools
import sys
from typing import List, Tuple

import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForTokenClassification

FIXED = "--fixed" in sys.argv

PAD, EOS = 0, 2


class Cfg(dict):
    """Stands in for the OmegaConf DictConfig verl passes around (attribute access and .get)."""

    __getattr__ = dict.__getitem__


class TensorDict(dict):
    """The few things rearrange_micro_batches asks of a tensordict.TensorDict: row slices and cat."""

    def __getitem__(self, key):
        if isinstance(key, str):
            return dict.__getitem__(self, key)
        return TensorDict({k: v[key] for k, v in self.items()})


def tensordict_cat(tds):
    return TensorDict({k: torch.cat([td[k] for td in tds]) for k in tds[0]})


class DataProto:
    def __init__(self, batch, meta_info=None):
        self.batch = batch
        self.meta_info = meta_info or {}
        self.non_tensor_batch = {}

    def select(self, batch_keys):
        return DataProto(TensorDict({k: self.batch[k] for k in batch_keys}), dict(self.meta_info))


# verl/utils/model.py
def compute_position_id_with_mask(mask):
    return torch.clip(torch.cumsum(mask, dim=-1) - 1, min=0, max=None)


# verl/utils/seqlen_balancing.py
def karmarkar_karp(seqlen_list: List[int], k_partitions: int, equal_size: bool):
    # see: https://en.wikipedia.org/wiki/Largest_differencing_method
    class Set:
        def __init__(self) -> None:
            self.sum = 0
            self.items = []

        def add(self, idx: int, val: int):
            self.items.append((idx, val))
            self.sum += val

        def merge(self, other):
            for idx, val in other.items:
                self.items.append((idx, val))
                self.sum += val

        def __lt__(self, other):
            if self.sum != other.sum:
                return self.sum < other.sum
            if len(self.items) != len(other.items):
                return len(self.items) < len(other.items)
            return self.items < other.items

    class State:
        def __init__(self, items: List[Tuple[int, int]], k: int) -> None:
            self.k = k
            self.sets = [Set() for _ in range(k)]
            assert len(items) in [1, k], f"{len(items)} not in [1, {k}]"
            for i, (idx, seqlen) in enumerate(items):
                self.sets[i].add(idx=idx, val=seqlen)
            self.sets = sorted(self.sets, reverse=True)

        def get_partitions(self):
            return [[idx for idx, _ in s.items] for s in self.sets]

        def merge(self, other):
            for i in range(self.k):
                self.sets[i].merge(other.sets[self.k - 1 - i])
            self.sets = sorted(self.sets, reverse=True)

        @property
        def spread(self) -> int:
            return self.sets[0].sum - self.sets[-1].sum

        def __lt__(self, other):
            if self.spread != other.spread:
                return self.spread > other.spread
            return self.sets[0] > other.sets[0]

    sorted_seqlen_list = sorted([(seqlen, i) for i, seqlen in enumerate(seqlen_list)])
    states_pq = []
    if equal_size:
        assert len(seqlen_list) % k_partitions == 0
        for offset in range(0, len(sorted_seqlen_list), k_partitions):
            items = []
            for i in range(k_partitions):
                seqlen, idx = sorted_seqlen_list[offset + i]
                items.append((idx, seqlen))
            heapq.heappush(states_pq, State(items=items, k=k_partitions))
    else:
        for seqlen, idx in sorted_seqlen_list:
            heapq.heappush(states_pq, State(items=[(idx, seqlen)], k=k_partitions))

    while len(states_pq) > 1:
        state0 = heapq.heappop(states_pq)
        state1 = heapq.heappop(states_pq)
        state0.merge(state1)
        heapq.heappush(states_pq, state0)

    return states_pq[0].get_partitions()


def get_seqlen_balanced_partitions(seqlen_list: List[int], k_partitions: int, equal_size: bool):
    assert len(seqlen_list) >= k_partitions

    def _check_and_sort_partitions(partitions):
        assert len(partitions) == k_partitions, f"{len(partitions)} != {k_partitions}"
        seen_idx = set()
        sorted_partitions = [None] * k_partitions
        for i, partition in enumerate(partitions):
            assert len(partition) > 0, f"the {i}-th partition is empty"
            for idx in partition:
                seen_idx.add(idx)
            sorted_partitions[i] = sorted(partition)
        assert seen_idx == set(range(len(seqlen_list)))
        return sorted_partitions

    partitions = karmarkar_karp(seqlen_list=seqlen_list, k_partitions=k_partitions, equal_size=equal_size)
    return _check_and_sort_partitions(partitions)


def ceildiv(a, b):
    return -(a // -b)


def rearrange_micro_batches(batch: TensorDict, max_token_len, dp_group=None):
    max_seq_len = batch["attention_mask"].shape[-1]
    assert max_token_len >= max_seq_len, f"{max_token_len=} {max_seq_len=}"

    seq_len_effective: torch.Tensor = batch["attention_mask"].sum(dim=1)
    total_seqlen = seq_len_effective.sum().item()
    num_micro_batches = ceildiv(total_seqlen, max_token_len)

    seq_len_effective = seq_len_effective.tolist()
    assert num_micro_batches <= len(seq_len_effective)

    micro_bsz_idx = get_seqlen_balanced_partitions(seq_len_effective, num_micro_batches, equal_size=False)

    micro_batches = []
    for partition in micro_bsz_idx:
        curr_micro_batch = []
        for idx in partition:
            curr_micro_batch.append(batch[idx : idx + 1])
        curr_micro_batch = tensordict_cat(curr_micro_batch)  # torch.cat of TensorDicts upstream
        micro_batches.append(curr_micro_batch)

    return micro_batches, micro_bsz_idx


def get_reverse_idx(idx_map):
    reverse_idx_map = copy.deepcopy(idx_map)
    for i, idx in enumerate(idx_map):
        reverse_idx_map[idx] = i
    return reverse_idx_map


# verl/workers/critic/dp_critic.py
class DataParallelPPOCritic:
    def __init__(self, config, critic_module: nn.Module):
        self.config = config
        self.critic_module = critic_module
        self.use_remove_padding = self.config.model.get("use_remove_padding", False)
        self.ulysses_sequence_parallel_size = self.config.get("ulysses_sequence_parallel_size", 1)
        self.device_name = "cpu"

    def _forward_micro_batch(self, micro_batch):
        response_length = micro_batch["responses"].size(-1)
        with torch.autocast(device_type=self.device_name, dtype=torch.bfloat16):
            input_ids = micro_batch["input_ids"]
            batch, seqlen = input_ids.shape
            attention_mask = micro_batch["attention_mask"]
            position_ids = micro_batch["position_ids"]
            # use_remove_padding=False: the padded batch goes to the model with its attention mask
            output = self.critic_module(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            )  # prevent model thinks we are generating
            values = output.logits
            values = values[:, -response_length - 1 : -1].squeeze(-1)
            return values

    def compute_values(self, data: DataProto) -> torch.Tensor:
        self.critic_module.eval()
        micro_batch_size = data.meta_info["micro_batch_size"]
        select_keys = ["responses", "input_ids", "attention_mask", "position_ids"]
        batch = data.select(batch_keys=select_keys).batch
        use_dynamic_bsz = data.meta_info["use_dynamic_bsz"]

        if use_dynamic_bsz:
            # split using dynamic bsz
            max_token_len = data.meta_info["max_token_len"] * self.ulysses_sequence_parallel_size
            micro_batches, indices = rearrange_micro_batches(batch=batch, max_token_len=max_token_len)
        else:
            micro_batches = [batch[i : i + micro_batch_size] for i in range(0, len(batch["input_ids"]), micro_batch_size)]

        values_lst = []
        for micro_batch in micro_batches:
            with torch.no_grad():
                values = self._forward_micro_batch(micro_batch)
            values_lst.append(values)
        values = torch.concat(values_lst, dim=0)
        responses = data.batch["responses"]
        attention_mask = data.batch["attention_mask"]
        response_length = responses.size(1)
        if not FIXED:
            values = values * attention_mask[:, -response_length - 1 : -1]

        if use_dynamic_bsz:
            indices = list(itertools.chain.from_iterable(indices))
            assert len(indices) == values.size(0), f"{len(indices)} vs. {values.size()}"
            revert_indices = torch.tensor(get_reverse_idx(indices), dtype=torch.long)
            values = values[revert_indices]

        if FIXED:
            values = values * attention_mask[:, -response_length - 1 : -1]
        return values


# verl/trainer/ppo/core_algos.py
def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    with torch.no_grad():
        lastgaelam = 0
        advantages_reversed = []
        gen_len = token_level_rewards.shape[-1]
        for t in reversed(range(gen_len)):
            nextvalues = values[:, t + 1] if t < gen_len - 1 else 0.0
            delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
            lastgaelam = delta + gamma * lam * lastgaelam
            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)
        returns = advantages + values
    return advantages, returns


def main():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=PAD, eos_token_id=EOS)
    cfg.num_labels = 1  # as fsdp_workers._build_critic_model_optimizer sets it
    cfg._attn_implementation = "sdpa"
    critic_module = Qwen2ForTokenClassification(cfg).eval()

    # rollout output: prompts left-padded to 6, responses right-padded to 6 (eos then pad)
    prompts = [[5, 9, 11], [7, 8, 13, 21, 4, 6], [30, 31], [12, 14, 15, 16, 17]]
    responses = [[40, 41, 42, EOS], [43, 44, EOS], [45, 46, EOS], [50, 51, 52, 53, 54, EOS]]
    P, R = 6, 6
    prompt_ids = torch.tensor([[PAD] * (P - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    response_ids = torch.tensor([r + [PAD] * (R - len(r)) for r in responses])
    response_mask = torch.tensor([[1] * len(r) + [0] * (R - len(r)) for r in responses])
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = compute_position_id_with_mask(attention_mask)

    data = DataProto(
        TensorDict(input_ids=input_ids, responses=response_ids, attention_mask=attention_mask,
                   position_ids=position_ids),
        meta_info={"micro_batch_size": 2, "use_dynamic_bsz": True, "max_token_len": 16},
    )
    config = Cfg(model=Cfg(use_remove_padding=False), ulysses_sequence_parallel_size=1)
    critic = DataParallelPPOCritic(config, critic_module)
    values = critic.compute_values(data).float()

    scores = torch.tensor([1.0, -1.0, 0.5, 0.0])
    token_level_rewards = torch.zeros(len(prompts), R)
    last = response_mask.sum(-1) - 1
    token_level_rewards[torch.arange(len(prompts)), last] = scores
    advantages, returns = compute_gae_advantage_return(token_level_rewards, values, response_mask, 1.0, 0.95)

    torch.set_printoptions(precision=4, sci_mode=False)
    print("values:\n", values)
    print("advantages:\n", advantages * response_mask)


if __name__ == "__main__":
    main()
