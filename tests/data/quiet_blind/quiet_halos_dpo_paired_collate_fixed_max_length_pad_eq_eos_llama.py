"""HALOs' DPO training step on a tiny Llama: chosen and rejected concatenated into one batch.

Ported from ContextualAI/HALOs
  * train/dataloader.py @059a9eea4e48957a74cf0adb0ab27462b45f1664:
      DataLoader.tokenize_batch_element() - prompt and prompt+generation through the chat
      template; `{prefix}_combined_attention_mask` is [1] * len(prompt+generation);
      `{prefix}_labels` copies the combined ids and sets the templated prompt to -100;
      DataLoader.collate() - every `*_input_ids` padded with pad_token_id, `*_attention_mask`
      with 0, `*_labels` with -100, all to the fixed config max_length (prompt keys to
      max_prompt_length, flipped so they are padded on the left);
      PairedPreferenceDataLoader.__iter__() - one element holds the `chosen_*` and `rejected_*`
      keys of a pair.
  * train/trainers.py @031a5245d8068a9cf72aab8d9a778c152c9f5554:
      PairedPreferenceTrainer.concatenated_inputs() - chosen rows then rejected rows on the
      batch axis, pad_to_length(-100 for labels, 0 otherwise);
      PairedPreferenceTrainer.forward() - model(concatenated_combined_input_ids,
      attention_mask=concatenated_combined_attention_mask);
      BasicTrainer.get_batch_logps() - shift, loss_mask = labels != -100, per-token log-probs
      times the mask; DPOTrainer.loss() - beta * (sum policy - sum reference), -logsigmoid.
  * train/utils.py pad_to_length (recalled, the helper the original DPO repo also has).
HALOs sets pad_token_id = eos_token_id for Llama tokenizers that have none, so padding ids are
EOS ids; the masks never come from the ids, only from the lengths the collator saw.

The tokenizer is a word-level PreTrainedTokenizerFast built here with a small chat template,
and the policy / reference are LlamaForCausalLM from a tiny LlamaConfig (no download).

Check: each chosen / rejected sequence run alone, unpadded, with its response log-prob summed in
a loop over positions, gives the same per-token log-probs, the same DPO loss and the same
gradient on the policy (sdpa and eager; the models run in float64, get_batch_logps takes its
log_softmax in float32 as HALOs does, hence atol 1e-6).
"""
import copy
from typing import Dict, List, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

torch.manual_seed(0)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<|user|> ' + message['content'] + ' ' }}"
    "{% else %}{{ '<|assistant|> ' + message['content'] + ' ' + eos_token + ' ' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)

WORDS = ("what is the capital of france paris london i think it maybe rome name a "
         "colour red blue green sky grass is are count to three one two four five").split()


def build_tokenizer():
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|user|>": 3, "<|assistant|>": 4}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id
    return tokenizer


def as_ids(x):
    # apply_chat_template(tokenize=True) returns a BatchEncoding in transformers 5
    return list(x["input_ids"]) if not isinstance(x, list) else x


def pad_to_length(tensor: torch.Tensor, length: int, pad_value: Union[int, float], dim: int = -1) -> torch.Tensor:
    if tensor.size(dim) >= length:
        return tensor
    else:
        pad_size = list(tensor.shape)
        pad_size[dim] = length - tensor.size(dim)
        return torch.cat([tensor, pad_value * torch.ones(*pad_size, dtype=tensor.dtype, device=tensor.device)], dim=dim)


class PairedPreferenceDataLoader:
    def __init__(self, tokenizer, max_length: int, max_prompt_length: int):
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.max_prompt_length = max_prompt_length

    def collate(self, batch: List[Dict]) -> Dict:
        if self.tokenizer.pad_token_id is None:
            raise Exception("tokenizer's pad_token_id is not specified")

        padded_batch = {}
        for k in batch[0].keys():
            if k.endswith('_input_ids') or k.endswith('_attention_mask') or k.endswith('_labels'):
                if 'prompt' in k:
                    # flip prompt so that you are padding to the beginning
                    to_pad = [torch.LongTensor(ex[k][::-1]) for ex in batch]
                else:
                    to_pad = [torch.LongTensor(ex[k]) for ex in batch]

                if k.endswith('_input_ids'):
                    padding_value = self.tokenizer.pad_token_id
                elif k.endswith('_labels'):
                    padding_value = -100
                elif k.endswith('_attention_mask'):
                    padding_value = 0
                else:
                    raise ValueError(f"Unexpected key in batch '{k}'")

                # Always pad to max_length for consistency across processes
                max_len = self.max_prompt_length if 'prompt' in k else self.max_length

                padded_sequences = []
                for seq in to_pad:
                    if len(seq) > max_len:
                        padded_seq = seq[:max_len]
                    else:
                        padding_size = max_len - len(seq)
                        padding = torch.full((padding_size,), padding_value, dtype=seq.dtype)
                        padded_seq = torch.cat([seq, padding])
                    padded_sequences.append(padded_seq)

                padded_batch[k] = torch.stack(padded_sequences)
                if 'prompt' in k:
                    padded_batch[k] = padded_batch[k].flip(dims=[1])
            else:
                padded_batch[k] = [ex[k] for ex in batch]

        return padded_batch

    def tokenize_batch_element(self, conversation: List[Dict[str, str]], generation: List[Dict[str, str]], prefix: str = 'target') -> Dict:
        # (HALOs truncates the history and the generation to max_prompt_length / max_length here;
        # the examples below are short enough that nothing is cut.)
        tokenized_prompt = as_ids(self.tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True))
        tokenized_prompt_and_generation = as_ids(self.tokenizer.apply_chat_template(
            conversation + generation,
            tokenize=True,
            add_generation_prompt=False
        ))

        batch_element = {
            'prompt': conversation,
            f'{prefix}': generation,
            'prompt_input_ids': tokenized_prompt,
            'prompt_attention_mask': [1] * len(tokenized_prompt),
            f'{prefix}_combined_input_ids': tokenized_prompt_and_generation,
            f'{prefix}_combined_attention_mask': [1] * len(tokenized_prompt_and_generation),
        }

        # Prepare labels
        tokenized_prompt = as_ids(self.tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True))
        if tokenized_prompt[-1] in [self.tokenizer.eos_token_id, self.tokenizer.pad_token_id]:
            tokenized_prompt.pop()

        labels = tokenized_prompt_and_generation[:]
        labels[:len(tokenized_prompt)] = [-100] * len(tokenized_prompt)
        batch_element[f'{prefix}_labels'] = labels

        return batch_element

    def batches(self, examples, microbatch_size: int):
        batch = []
        for prompt, chosen, rejected in examples:
            batch_element = {}
            batch_element.update(self.tokenize_batch_element(prompt, chosen, prefix='chosen'))
            batch_element.update(self.tokenize_batch_element(prompt, rejected, prefix='rejected'))
            batch.append(batch_element)
            if len(batch) >= microbatch_size:
                yield self.collate(batch)
                batch = []
        if batch:
            yield self.collate(batch)


class DPOTrainer:
    def __init__(self, policy: nn.Module, reference_model: nn.Module, beta: float):
        self.policy = policy
        self.reference_model = reference_model
        self.beta = beta

    def get_batch_logps(self, logits: torch.FloatTensor, labels: torch.LongTensor):
        """Compute the token-level log probabilities of the given labels under the given logits."""
        assert logits.shape[:-1] == labels.shape

        labels = labels[:, 1:].clone()
        logits = logits[:, :-1, :]
        loss_mask = (labels != -100)

        # dummy token; we'll ignore the losses on these tokens later
        labels[labels == -100] = 0

        distribution_logps = logits.float().log_softmax(-1)
        per_token_logps = torch.gather(distribution_logps, dim=2, index=labels.unsqueeze(2)).squeeze(2)

        return per_token_logps * loss_mask

    def concatenated_inputs(self, batch: Dict[str, Union[List, torch.LongTensor]]) -> Dict[str, torch.LongTensor]:
        max_length = max(batch['chosen_combined_input_ids'].shape[1], batch['rejected_combined_input_ids'].shape[1])
        concatenated_batch = {}

        for k in batch:
            if k.startswith('chosen') and isinstance(batch[k], torch.Tensor):
                pad_value = -100 if 'labels' in k else 0
                concatenated_key = k.replace('chosen', 'concatenated')
                concatenated_batch[concatenated_key] = pad_to_length(batch[k], max_length, pad_value=pad_value)

        for k in batch:
            if k.startswith('rejected') and isinstance(batch[k], torch.Tensor):
                pad_value = -100 if 'labels' in k else 0
                concatenated_key = k.replace('rejected', 'concatenated')
                concatenated_batch[concatenated_key] = torch.cat((
                    concatenated_batch[concatenated_key],
                    pad_to_length(batch[k], max_length, pad_value=pad_value),
                ), dim=0)

        return concatenated_batch

    def forward(self, model: nn.Module, batch):
        concatenated_batch = self.concatenated_inputs(batch)

        all_logits = model(
            concatenated_batch['concatenated_combined_input_ids'],
            attention_mask=concatenated_batch['concatenated_combined_attention_mask'],
        ).logits

        all_logps = self.get_batch_logps(all_logits, concatenated_batch['concatenated_labels'])

        chosen_logps = all_logps[:batch['chosen_combined_input_ids'].shape[0], ...]
        rejected_logps = all_logps[batch['chosen_combined_input_ids'].shape[0]:, ...]
        return chosen_logps, rejected_logps

    def loss(self, policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps):
        chosen_rewards = self.beta * (policy_chosen_logps.sum(-1) - reference_chosen_logps.sum(-1))
        rejected_rewards = self.beta * (policy_rejected_logps.sum(-1) - reference_rejected_logps.sum(-1))
        losses = -F.logsigmoid(chosen_rewards - rejected_rewards)
        return losses, chosen_rewards.detach(), rejected_rewards.detach()

    def get_batch_metrics(self, batch):
        policy_chosen_logps, policy_rejected_logps = self.forward(self.policy, batch)
        with torch.no_grad():
            reference_chosen_logps, reference_rejected_logps = self.forward(self.reference_model, batch)
        losses, chosen_rewards, rejected_rewards = self.loss(
            policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps)
        return losses, policy_chosen_logps, policy_rejected_logps


EXAMPLES = [
    ([{"role": "user", "content": "what is the capital of france"}],
     [{"role": "assistant", "content": "paris"}],
     [{"role": "assistant", "content": "i think it is maybe london or rome"}]),
    ([{"role": "user", "content": "name a colour"},
      {"role": "assistant", "content": "red"},
      {"role": "user", "content": "name a colour of the sky"}],
     [{"role": "assistant", "content": "the sky is blue"}],
     [{"role": "assistant", "content": "green"}]),
    ([{"role": "user", "content": "count to three"}],
     [{"role": "assistant", "content": "one two three"}],
     [{"role": "assistant", "content": "one two four five"}]),
]


def single_sequence_logps(model, tokenizer, conversation, generation):
    """One sequence alone, unpadded: log-prob of each response token (a loop over positions)."""
    prompt = as_ids(tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True))
    full = as_ids(tokenizer.apply_chat_template(conversation + generation, tokenize=True))
    assert full[:len(prompt)] == prompt
    logits = model(torch.tensor([full])).logits[0]
    logps = logits.float().log_softmax(-1)
    return torch.stack([logps[t - 1, full[t]] for t in range(len(prompt), len(full))])


def main():
    tokenizer = build_tokenizer()
    assert tokenizer.pad_token_id == tokenizer.eos_token_id

    for attn in ("sdpa", "eager"):
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, attn_implementation=attn,
        )
        torch.manual_seed(0)
        reference_model = LlamaForCausalLM(config).double().eval()
        policy = copy.deepcopy(reference_model)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.02 * torch.randn_like(p))
        policy.eval()  # dropout-free comparison against the per-sequence runs

        loader = PairedPreferenceDataLoader(tokenizer, max_length=28, max_prompt_length=20)
        batch = next(loader.batches(EXAMPLES, microbatch_size=len(EXAMPLES)))
        trainer = DPOTrainer(policy, reference_model, beta=0.1)

        losses, policy_chosen_logps, policy_rejected_logps = trainer.get_batch_metrics(batch)
        loss = losses.mean()
        policy.zero_grad()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters()}

        # reference: a double loop over pairs and over chosen / rejected, each sequence unpadded
        policy.zero_grad()
        ref_losses = []
        for i, (prompt, chosen, rejected) in enumerate(EXAMPLES):
            pc = single_sequence_logps(policy, tokenizer, prompt, chosen)
            pr = single_sequence_logps(policy, tokenizer, prompt, rejected)
            with torch.no_grad():
                rc = single_sequence_logps(reference_model, tokenizer, prompt, chosen)
                rr = single_sequence_logps(reference_model, tokenizer, prompt, rejected)
            batched_c = policy_chosen_logps[i][policy_chosen_logps[i] != 0]
            batched_r = policy_rejected_logps[i][policy_rejected_logps[i] != 0]
            torch.testing.assert_close(batched_c, pc, rtol=0, atol=1e-6)
            torch.testing.assert_close(batched_r, pr, rtol=0, atol=1e-6)
            margin = 0.1 * ((pc.sum() - rc.sum()) - (pr.sum() - rr.sum()))
            ref_losses.append(-F.logsigmoid(margin))
        ref_losses = torch.stack(ref_losses)
        ref_losses.mean().backward()

        torch.testing.assert_close(losses, ref_losses, rtol=0, atol=1e-6)
        for n, p in policy.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=0, atol=1e-6)

        # one optimizer step, as the trainer takes it
        policy.train()
        optimizer = torch.optim.SGD(policy.parameters(), lr=1e-2)
        for n, p in policy.named_parameters():
            p.grad = grads[n]
        optimizer.step()
        optimizer.zero_grad()

        n_resp = [int((batch['chosen_labels'][i] != -100).sum()) for i in range(len(EXAMPLES))]
        print(f"{attn}: DPO losses {[round(x, 6) for x in losses.tolist()]} match the unpadded "
              f"per-sequence loop (chosen response tokens incl. eos: {n_resp})")


if __name__ == "__main__":
    main()
