"""The reference DPO implementation's training step: chosen and rejected concatenated on the batch axis for one
policy pass and one reference pass, summed response log-probs, DPO / IPO / SFT losses, and the eval-time samples
generated from left-padded prompts (correct program).

Port, shrunk to toy sizes, of eric-mitchell/direct-preference-optimization
@f8b8c0f49dc92a430bae41585f9d467d3618fe2f (trainers.py last changed in 8a4023f, preference_datasets.py in 21fd7fe):
  preference_datasets.py
      tokenize_batch_element: prompt / chosen / rejected tokenized without special tokens, EOS appended to each
          response with attention 1, prompt truncated (keep_end for hh) when prompt + longer response > max_length,
          labels = input_ids with -100 over the prompt
      get_collate_fn: every *_input_ids / *_attention_mask / *_labels key padded with pad_sequence (pad id, 0,
          -100); the prompt keys are reversed, padded, and flipped back so their padding is on the left
  utils.py: pad_to_length
  trainers.py
      concatenated_inputs: chosen then rejected, each pad_to_length'ed to the longer of the two (input_ids and
          attention_mask with 0, labels with -100), cat on dim 0
      BasicTrainer.concatenated_forward: model(ids, attention_mask=mask).logits -> _get_batch_logps
      _get_batch_logps: labels[:, 1:], logits[:, :-1], loss_mask = labels != -100, gather of log_softmax, sum
      preference_loss (dpo with label_smoothing, ipo), get_batch_metrics (policy pass, reference pass under
          no_grad, sft branch on chosen only), get_batch_samples (policy.generate from
          prompt_input_ids / prompt_attention_mask, pad_to_length to max_length, batch_decode)
  config/model/pythia28.yaml (GPT-NeoX policy), trainer: tokenizer.pad_token_id = eos_token_id when unset.

The pythia tokenizer has no pad token, so pad == EOS: every padded position is told apart by the collator's
attention_mask (0) and labels (-100), never by its id; the EOS that ends each response keeps attention 1 and its
label.  Chosen / rejected rows are right-padded, so a real token never has a pad before it; the prompt rows are
left-padded and generate() gets their mask.

Deviation: get_batch_samples samples (do_sample=True); here DO_SAMPLE = False so the samples can be compared.

Self-check (reference): every (prompt, response) pair run alone, unpadded, no mask, the response log-prob summed by
a loop over its tokens; the policy / reference chosen and rejected log-probs, the DPO, IPO and SFT losses, the
rewards, and each prompt's greedy continuation computed by a loop of full forwards on the prompt alone.
"""
import string
from typing import Callable, Dict, List, Union

import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch.nn.utils.rnn import pad_sequence

torch.manual_seed(0)

DO_SAMPLE = False
MAX_LENGTH = 52  # config.max_length
MAX_PROMPT_LENGTH = 32  # config.max_prompt_length
BETA = 0.1
LABEL_SMOOTHING = 0.0


# ---------------------------------------------------------------- a character-level stand-in for the pythia tokenizer
def make_tokenizer():
    vocab = {"<|endoftext|>": 0}
    for c in string.ascii_letters + string.digits + " \n.,?!:'":
        vocab[c] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tk.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tk.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", unk_token="<|endoftext|>")


# ---------------------------------------------------------------- utils.py
def pad_to_length(tensor: torch.Tensor, length: int, pad_value: Union[int, float], dim: int = -1) -> torch.Tensor:
    if tensor.size(dim) >= length:
        return tensor
    else:
        pad_size = list(tensor.shape)
        pad_size[dim] = length - tensor.size(dim)
        return torch.cat([tensor, pad_value * torch.ones(*pad_size, dtype=tensor.dtype, device=tensor.device)], dim=dim)


# ---------------------------------------------------------------- preference_datasets.py
def get_collate_fn(tokenizer) -> Callable[[List[Dict]], Dict[str, Union[List, torch.Tensor]]]:
    def collate_fn(batch):
        # first, pad everything to the same length
        padded_batch = {}
        for k in batch[0].keys():
            if k.endswith('_input_ids') or k.endswith('_attention_mask') or k.endswith('_labels'):
                if 'prompt' in k:  # adapted from https://stackoverflow.com/questions/73256206
                    to_pad = [torch.LongTensor(ex[k][::-1]) for ex in batch]
                else:
                    to_pad = [torch.LongTensor(ex[k]) for ex in batch]
                if k.endswith('_input_ids'):
                    padding_value = tokenizer.pad_token_id
                elif k.endswith('_labels'):
                    padding_value = -100
                elif k.endswith('_attention_mask'):
                    padding_value = 0
                else:
                    raise ValueError(f"Unexpected key in batch '{k}'")

                padded_batch[k] = pad_sequence(to_pad, batch_first=True, padding_value=padding_value)
                if 'prompt' in k:  # for the prompt, flip back so padding is on left side
                    padded_batch[k] = padded_batch[k].flip(dims=[1])
            else:
                padded_batch[k] = [ex[k] for ex in batch]

        return padded_batch
    return collate_fn


def tokenize_batch_element(prompt: str, chosen: str, rejected: str, truncation_mode: str, tokenizer, max_length: int, max_prompt_length: int) -> Dict:
    chosen_tokens = tokenizer(chosen, add_special_tokens=False)
    rejected_tokens = tokenizer(rejected, add_special_tokens=False)
    prompt_tokens = tokenizer(prompt, add_special_tokens=False)
    chosen_tokens = {k: list(v) for k, v in chosen_tokens.items()}
    rejected_tokens = {k: list(v) for k, v in rejected_tokens.items()}
    prompt_tokens = {k: list(v) for k, v in prompt_tokens.items()}

    assert tokenizer.eos_token_id not in prompt_tokens['input_ids'], f"Prompt contains EOS token: {prompt}"
    assert tokenizer.eos_token_id not in chosen_tokens['input_ids'], f"Chosen response contains EOS token: {chosen}"
    assert tokenizer.eos_token_id not in rejected_tokens['input_ids'], f"Rejected response contains EOS token: {rejected}"

    chosen_tokens['input_ids'].append(tokenizer.eos_token_id)
    chosen_tokens['attention_mask'].append(1)

    rejected_tokens['input_ids'].append(tokenizer.eos_token_id)
    rejected_tokens['attention_mask'].append(1)

    longer_response_length = max(len(chosen_tokens['input_ids']), len(rejected_tokens['input_ids']))

    # if combined sequence is too long, truncate the prompt
    if len(prompt_tokens['input_ids']) + longer_response_length > max_length:
        if truncation_mode == 'keep_start':
            prompt_tokens = {k: v[:max_prompt_length] for k, v in prompt_tokens.items()}
        elif truncation_mode == 'keep_end':
            prompt_tokens = {k: v[-max_prompt_length:] for k, v in prompt_tokens.items()}
        else:
            raise ValueError(f'Unknown truncation mode: {truncation_mode}')

    # if that's still too long, truncate the response
    if len(prompt_tokens['input_ids']) + longer_response_length > max_length:
        chosen_tokens = {k: v[:max_length - max_prompt_length] for k, v in chosen_tokens.items()}
        rejected_tokens = {k: v[:max_length - max_prompt_length] for k, v in rejected_tokens.items()}

    # Create labels
    chosen_sequence_tokens = {k: prompt_tokens[k] + chosen_tokens[k] for k in chosen_tokens}
    rejected_sequence_tokens = {k: prompt_tokens[k] + rejected_tokens[k] for k in rejected_tokens}
    chosen_sequence_tokens['labels'] = chosen_sequence_tokens['input_ids'][:]
    chosen_sequence_tokens['labels'][:len(prompt_tokens['input_ids'])] = [-100] * len(prompt_tokens['input_ids'])
    rejected_sequence_tokens['labels'] = rejected_sequence_tokens['input_ids'][:]
    rejected_sequence_tokens['labels'][:len(prompt_tokens['input_ids'])] = [-100] * len(prompt_tokens['input_ids'])

    batch = {}

    batch['prompt'] = prompt
    batch['chosen'] = prompt + chosen
    batch['rejected'] = prompt + rejected
    batch['chosen_response_only'] = chosen
    batch['rejected_response_only'] = rejected

    for k, toks in {'chosen': chosen_sequence_tokens, 'rejected': rejected_sequence_tokens, 'prompt': prompt_tokens}.items():
        for type_key, tokens in toks.items():
            if type_key == 'token_type_ids':
                continue
            batch[f'{k}_{type_key}'] = tokens

    return batch


# ---------------------------------------------------------------- trainers.py
def preference_loss(policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps,
                    beta: float, label_smoothing: float = 0.0, ipo: bool = False, reference_free: bool = False):
    pi_logratios = policy_chosen_logps - policy_rejected_logps
    ref_logratios = reference_chosen_logps - reference_rejected_logps

    if reference_free:
        ref_logratios = 0

    logits = pi_logratios - ref_logratios  # also known as h_{\pi_\theta}^{y_w,y_l}

    if ipo:
        losses = (logits - 1/(2 * beta)) ** 2  # Eq. 17 of https://arxiv.org/pdf/2310.12036v2.pdf
    else:
        losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing

    chosen_rewards = beta * (policy_chosen_logps - reference_chosen_logps).detach()
    rejected_rewards = beta * (policy_rejected_logps - reference_rejected_logps).detach()

    return losses, chosen_rewards, rejected_rewards


def _get_batch_logps(logits: torch.FloatTensor, labels: torch.LongTensor, average_log_prob: bool = False) -> torch.FloatTensor:
    assert logits.shape[:-1] == labels.shape

    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    loss_mask = (labels != -100)

    # dummy token; we'll ignore the losses on these tokens later
    labels[labels == -100] = 0

    per_token_logps = torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)

    if average_log_prob:
        return (per_token_logps * loss_mask).sum(-1) / loss_mask.sum(-1)
    else:
        return (per_token_logps * loss_mask).sum(-1)


def concatenated_inputs(batch: Dict[str, Union[List, torch.LongTensor]]) -> Dict[str, torch.LongTensor]:
    max_length = max(batch['chosen_input_ids'].shape[1], batch['rejected_input_ids'].shape[1])
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


class BasicTrainer(object):
    def __init__(self, policy, config, tokenizer, reference_model=None):
        self.config = config
        self.tokenizer = tokenizer
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token_id = self.tokenizer.eos_token_id
        self.policy = policy
        self.reference_model = reference_model

    def get_batch_samples(self, batch: Dict[str, torch.LongTensor]):
        """Generate samples from the policy (and reference model, if doing DPO training) for the given batch of inputs."""
        policy_output = self.policy.generate(
            batch['prompt_input_ids'], attention_mask=batch['prompt_attention_mask'], max_length=self.config['max_length'], do_sample=DO_SAMPLE, pad_token_id=self.tokenizer.pad_token_id)

        if self.config['loss'] in {'dpo', 'ipo'}:
            reference_output = self.reference_model.generate(
                batch['prompt_input_ids'], attention_mask=batch['prompt_attention_mask'], max_length=self.config['max_length'], do_sample=DO_SAMPLE, pad_token_id=self.tokenizer.pad_token_id)

        policy_output = pad_to_length(policy_output, self.config['max_length'], self.tokenizer.pad_token_id)
        policy_output_decoded = self.tokenizer.batch_decode(policy_output, skip_special_tokens=True)

        if self.config['loss'] in {'dpo', 'ipo'}:
            reference_output = pad_to_length(reference_output, self.config['max_length'], self.tokenizer.pad_token_id)
            reference_output_decoded = self.tokenizer.batch_decode(reference_output, skip_special_tokens=True)
        else:
            reference_output_decoded = []

        return policy_output_decoded, reference_output_decoded

    def concatenated_forward(self, model, batch):
        concatenated_batch = concatenated_inputs(batch)
        all_logits = model(concatenated_batch['concatenated_input_ids'], attention_mask=concatenated_batch['concatenated_attention_mask']).logits.to(torch.float32)
        all_logps = _get_batch_logps(all_logits, concatenated_batch['concatenated_labels'], average_log_prob=False)
        chosen_logps = all_logps[:batch['chosen_input_ids'].shape[0]]
        rejected_logps = all_logps[batch['chosen_input_ids'].shape[0]:]
        return chosen_logps, rejected_logps

    def get_batch_metrics(self, batch, loss_name: str):
        metrics = {}
        if loss_name in {'dpo', 'ipo'}:
            policy_chosen_logps, policy_rejected_logps = self.concatenated_forward(self.policy, batch)
            with torch.no_grad():
                reference_chosen_logps, reference_rejected_logps = self.concatenated_forward(self.reference_model, batch)

            if loss_name == 'dpo':
                loss_kwargs = {'beta': BETA, 'reference_free': False, 'label_smoothing': LABEL_SMOOTHING, 'ipo': False}
            else:
                loss_kwargs = {'beta': BETA, 'ipo': True}

            losses, chosen_rewards, rejected_rewards = preference_loss(
                policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps, **loss_kwargs)
            metrics['rewards/chosen'] = chosen_rewards
            metrics['rewards/rejected'] = rejected_rewards
            metrics['logps/rejected'] = policy_rejected_logps.detach()
            metrics['ref_logps/chosen'] = reference_chosen_logps
            metrics['ref_logps/rejected'] = reference_rejected_logps
        elif loss_name == 'sft':
            policy_chosen_logits = self.policy(batch['chosen_input_ids'], attention_mask=batch['chosen_attention_mask']).logits.to(torch.float32)
            policy_chosen_logps = _get_batch_logps(policy_chosen_logits, batch['chosen_labels'], average_log_prob=False)
            losses = -policy_chosen_logps
        metrics['logps/chosen'] = policy_chosen_logps.detach()
        metrics['losses'] = losses.detach()
        return losses.mean(), metrics


# ---------------------------------------------------------------- data: Anthropic-HH-shaped (prompt, chosen, rejected)
def extract_anthropic_prompt(prompt_and_response):
    search_term = '\n\nAssistant:'
    search_term_idx = prompt_and_response.rfind(search_term)
    assert search_term_idx != -1, f"Prompt and response does not contain '{search_term}'"
    return prompt_and_response[:search_term_idx + len(search_term)]


HH_ROWS = [
    ("\n\nHuman: hi\n\nAssistant: hello there", "\n\nHuman: hi\n\nAssistant: go"),
    ("\n\nHuman: name a fruit\n\nAssistant: a pear", "\n\nHuman: name a fruit\n\nAssistant: no idea at all"),
    ("\n\nHuman: tell me a long story about the sea please\n\nAssistant: ok", "\n\nHuman: tell me a long story about the sea please\n\nAssistant: waves and more waves"),
    ("\n\nHuman: 2 plus 2?\n\nAssistant: 4", "\n\nHuman: 2 plus 2?\n\nAssistant: it is 5, I think"),
]


def main():
    tokenizer = make_tokenizer()
    config = {'max_length': MAX_LENGTH, 'max_prompt_length': MAX_PROMPT_LENGTH, 'loss': 'dpo'}

    neox = transformers.GPTNeoXConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, rotary_pct=0.25, max_position_embeddings=64, use_parallel_residual=True,
        bos_token_id=0, eos_token_id=0, attention_dropout=0.0, hidden_dropout=0.0,
    )
    neox._attn_implementation = "sdpa"
    policy = transformers.GPTNeoXForCausalLM(neox).eval()
    torch.manual_seed(1)
    reference_model = transformers.GPTNeoXForCausalLM(neox).eval()

    trainer = BasicTrainer(policy, config, tokenizer, reference_model=reference_model)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 0

    elements = []
    for chosen_text, rejected_text in HH_ROWS:
        prompt = extract_anthropic_prompt(chosen_text)
        elements.append(tokenize_batch_element(prompt, chosen_text[len(prompt):], rejected_text[len(prompt):],
                                               'keep_end', tokenizer, MAX_LENGTH, MAX_PROMPT_LENGTH))
    batch = get_collate_fn(tokenizer)(elements)
    assert batch['chosen_input_ids'].shape[1] != batch['rejected_input_ids'].shape[1]
    print("prompt lengths", batch["prompt_attention_mask"].sum(-1).tolist(), "chosen", batch["chosen_attention_mask"].sum(-1).tolist(), "rejected", batch["rejected_attention_mask"].sum(-1).tolist())

    loss_dpo, m_dpo = trainer.get_batch_metrics(batch, 'dpo')
    loss_ipo, m_ipo = trainer.get_batch_metrics(batch, 'ipo')
    loss_sft, m_sft = trainer.get_batch_metrics(batch, 'sft')
    with torch.no_grad():
        policy_samples, reference_samples = trainer.get_batch_samples(batch)

    # ------------------------------------------------------------ reference: every pair alone, unpadded, no mask
    def seq_logp(model, prompt_ids, response_ids):
        ids = torch.tensor([prompt_ids + response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        total = 0.0
        for j, tok in enumerate(response_ids):
            total = total + torch.log_softmax(logits[len(prompt_ids) + j - 1], -1)[tok]
        return total

    def greedy(model, prompt_ids, n_new):
        ids = list(prompt_ids)
        for _ in range(n_new):
            with torch.no_grad():
                nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt == tokenizer.eos_token_id:
                break
        return tokenizer.decode(ids, skip_special_tokens=True)

    n_new = MAX_LENGTH - batch['prompt_input_ids'].shape[1]
    ref = {k: [] for k in ('pc', 'pr', 'rc', 'rr')}
    for el in elements:
        p = el['prompt_input_ids']
        c = el['chosen_input_ids'][len(p):]
        r = el['rejected_input_ids'][len(p):]
        ref['pc'].append(seq_logp(policy, p, c))
        ref['pr'].append(seq_logp(policy, p, r))
        ref['rc'].append(seq_logp(reference_model, p, c))
        ref['rr'].append(seq_logp(reference_model, p, r))
    ref = {k: torch.stack(v) for k, v in ref.items()}

    tol = dict(atol=1e-4, rtol=1e-4)
    assert torch.allclose(m_dpo['logps/chosen'], ref['pc'], **tol), (m_dpo['logps/chosen'], ref['pc'])
    assert torch.allclose(m_dpo['logps/rejected'], ref['pr'], **tol), (m_dpo['logps/rejected'], ref['pr'])
    assert torch.allclose(m_dpo['ref_logps/chosen'], ref['rc'], **tol)
    assert torch.allclose(m_dpo['ref_logps/rejected'], ref['rr'], **tol)
    h = (ref['pc'] - ref['pr']) - (ref['rc'] - ref['rr'])
    assert torch.allclose(m_dpo['losses'], -F.logsigmoid(BETA * h), **tol)
    assert torch.allclose(loss_dpo, (-F.logsigmoid(BETA * h)).mean(), **tol)
    assert torch.allclose(m_dpo['rewards/chosen'], BETA * (ref['pc'] - ref['rc']), **tol)
    assert torch.allclose(m_dpo['rewards/rejected'], BETA * (ref['pr'] - ref['rr']), **tol)
    assert torch.allclose(loss_ipo, ((h - 1 / (2 * BETA)) ** 2).mean(), atol=1e-2, rtol=1e-4)
    assert torch.allclose(loss_sft, -ref['pc'].mean(), **tol)

    for i, el in enumerate(elements):
        p = el['prompt_input_ids']
        assert policy_samples[i] == greedy(policy, p, n_new), (policy_samples[i], greedy(policy, p, n_new))
        assert reference_samples[i] == greedy(reference_model, p, n_new)

    print("dpo loss %.5f  ipo loss %.5f  sft loss %.5f" % (loss_dpo.item(), loss_ipo.item(), loss_sft.item()))
    print("samples:", [s[-20:] for s in policy_samples])
    print("OK")


if __name__ == "__main__":
    main()
