# Citation: PKU-Alignment/align-anything align_anything/models/qwen2.py @32ab430b7b902b85a0dde2e85495f5f5ccb19733
#   (AccustomedQwen2RewardModel.forward: score_head, end_index, end_scores); align_anything/trainers/text_to_text/rm.py
#   @15cf6bd48380f7d25c6860e70a2ada9bf7b89983 (RMTrainer.init_models padding_side='right', RMTrainer.loss);
#   align_anything/datasets/text_to_text/preference.py @15cf6bd48380f7d25c6860e70a2ada9bf7b89983
#   (PreferenceDataset.preprocess, PreferenceCollator.__call__).
# align-anything's (safe-rlhf-style) score model trained on preference pairs. The PreferenceCollator puts every
# better conversation first and every worse one after them ((2B, L)), tokenizes them in one call with padding=True on
# the tokenizer's side (right, as RMTrainer loads it) and hands input_ids and attention_mask to the model. The Qwen2
# reward model scores every position (score_head over hidden_states[-1]) and reads each row's end score at
# `end_index = torch.cat([m.nonzero()[-1] for m in attention_mask])`, the last real token, by torch.gather. The loss
# chunks the end scores back into better / worse halves: -logsigmoid(higher - lower) plus a square regularizer.
# Self-check: each conversation run alone (no padding, no mask): its per-token scores at every real position, its end
# score and end hidden state at its last token; the loss and accuracy rebuilt by a loop over the pairs.
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2Model, Qwen2PreTrainedModel
from transformers.utils import ModelOutput

torch.manual_seed(0)


# ---- align_anything/models/reward_model.py ----
@dataclass
class ScoreModelOutput(ModelOutput):
    scores: torch.FloatTensor | None = None  # size = (B, L, D)
    end_scores: torch.FloatTensor | None = None  # size = (B, D)
    last_hidden_state: torch.FloatTensor | None = None  # size = (B, L, E)
    end_last_hidden_state: torch.FloatTensor | None = None  # size = (B, E)
    end_index: torch.LongTensor | None = None  # size = (B,)


# ---- align_anything/models/qwen2.py ----
class AccustomedQwen2RewardModel(Qwen2PreTrainedModel):

    supports_gradient_checkpointing = True

    def __init__(self, config):
        super().__init__(config)
        setattr(self, self.base_model_prefix, Qwen2Model(config))
        self.score_head = nn.Linear(config.hidden_size, 1, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        outputs = self.model(
            input_ids,
            attention_mask=attention_mask,
            output_hidden_states=True,
            **kwargs,
        )

        last_hidden_state = outputs.hidden_states[-1]
        scores = self.score_head(last_hidden_state).float()
        B, L, _ = last_hidden_state.size()

        if attention_mask is None:
            if B > 1:
                raise ValueError("'attention_mask' is required when batch size > 1.")
            attention_mask = last_hidden_state.new_ones(B, L, dtype=torch.bool)  # size = (B, L)

        end_index = torch.cat([m.nonzero()[-1] for m in attention_mask])  # size = (B,)
        end_last_hidden_state = torch.gather(  # size = (B, 1, E)
            last_hidden_state,
            dim=1,
            index=(
                end_index.to(last_hidden_state.device)
                .unsqueeze(dim=1)
                .unsqueeze(dim=2)
                .expand(-1, -1, last_hidden_state.size(-1))
            ),
        )
        end_scores = torch.gather(  # size = (B, 1, D)
            scores,
            dim=1,
            index=(
                end_index.to(scores.device)
                .unsqueeze(dim=1)
                .unsqueeze(dim=2)
                .expand(-1, -1, scores.size(-1))
            ),
        )
        end_last_hidden_state = end_last_hidden_state.squeeze(dim=1)  # size = (B, E)
        end_scores = end_scores.squeeze(dim=1)  # size = (B, D)

        return ScoreModelOutput(
            scores=scores,  # size = (B, L, D)
            end_scores=end_scores,  # size = (B, D)
            last_hidden_state=last_hidden_state,  # size = (B, L, E)
            end_last_hidden_state=end_last_hidden_state,  # size = (B, E)
            end_index=end_index,  # size = (B,)
        )


# ---- align_anything/datasets/text_to_text/preference.py ----
class PreferenceCollator:

    def __init__(self, tokenizer, padding_side: str = 'right') -> None:
        self.tokenizer = tokenizer
        self.padding_side = padding_side

    def __call__(self, samples):
        return_dict = {'meta_info': {}}
        concated_text = [sample['better_conversation'] for sample in samples] + [
            sample['worse_conversation'] for sample in samples
        ]  # size = (2 * B, L)
        tokenized_input = self.tokenizer(
            text=concated_text,
            return_tensors='pt',
            padding=True,
            padding_side=self.padding_side,
            return_attention_mask=True,
            add_special_tokens=False,
        )
        for key, value in tokenized_input.items():
            if isinstance(value, torch.Tensor):
                return_dict[key] = value

        better_response_lens = [sample['better_response_lens'] for sample in samples]
        worse_response_lens = [sample['worse_response_lens'] for sample in samples]
        return_dict['meta_info']['response_lens'] = better_response_lens + worse_response_lens

        return return_dict


# ---- a tiny word-level tokenizer standing in for the Qwen2 one (no download) ----
WORDS = (
    "BEGINNING OF CONVERSATION: USER: ASSISTANT: how can i stay safe online use strong passwords and two factor "
    "never share them just click every link what is two plus four six seven it is six because two and four make "
    "write a haiku about rain soft rain on roof tiles the night listens rain is wet"
).split()
SPECIALS = ["<|endoftext|>", "<|im_end|>", "[UNK]"]
vocab = {t: i for i, t in enumerate(SPECIALS)}
for w in WORDS:
    vocab.setdefault(w, len(vocab))
tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=tk, pad_token="<|endoftext|>", eos_token="<|im_end|>", unk_token="[UNK]"
)
tokenizer.padding_side = 'right'  # RMTrainer.init_models: load_pretrained_models(..., padding_side='right')

PROMPT_TEMPLATE = "BEGINNING OF CONVERSATION: USER: {input} ASSISTANT:"


def format_preference_sample(raw):
    prompt = PROMPT_TEMPLATE.format(input=raw['prompt'])
    better = raw['response_0'] if raw['better_response_id'] == 0 else raw['response_1']
    worse = raw['response_1'] if raw['better_response_id'] == 0 else raw['response_0']
    eos = tokenizer.eos_token
    return (
        f"{prompt} {better} {eos}",
        f"{prompt} {worse} {eos}",
        {'better_response': better, 'worse_response': worse},
    )


def preprocess(raw):
    better_conversation, worse_conversation, meta_info = format_preference_sample(raw)
    return {
        'better_response_lens': len(tokenizer(meta_info['better_response'], add_special_tokens=False)['input_ids']),
        'worse_response_lens': len(tokenizer(meta_info['worse_response'], add_special_tokens=False)['input_ids']),
        'better_conversation': better_conversation,
        'worse_conversation': worse_conversation,
    }


raw_data = [
    {'prompt': "how can i stay safe online", 'response_0': "just click every link",
     'response_1': "use strong passwords and two factor and never share them", 'better_response_id': 1},
    {'prompt': "what is two plus four", 'response_0': "it is six because two and four make six",
     'response_1': "seven", 'better_response_id': 0},
    {'prompt': "write a haiku about rain", 'response_0': "rain is wet",
     'response_1': "soft rain on roof tiles the night listens", 'better_response_id': 1},
]
samples = [preprocess(r) for r in raw_data]

config = Qwen2Config(
    vocab_size=len(vocab),
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=tokenizer.pad_token_id,
    eos_token_id=tokenizer.eos_token_id,
)
config._attn_implementation = "eager"
model = AccustomedQwen2RewardModel(config).eval()

cfgs = SimpleNamespace(train_cfgs=SimpleNamespace(regularization=0.001))
infer_batch = lambda batch: {k: v for k, v in batch.items() if k != 'meta_info'}


# ---- align_anything/trainers/text_to_text/rm.py (RMTrainer.loss) ----
def loss_fn(batch):
    (
        better_input_ids,  # size = (B, L)
        worse_input_ids,  # size = (B, L)
    ) = batch['input_ids'].chunk(chunks=2, dim=0)
    assert better_input_ids.size(0) == worse_input_ids.size(0), 'batch size mismatch!'
    output = model(**infer_batch(batch))
    scores = output.scores
    end_scores = output.end_scores
    higher_rewards, lower_rewards = scores.squeeze(dim=-1).chunk(chunks=2, dim=0)
    higher_end_reward, lower_end_reward = end_scores.squeeze(dim=-1).chunk(chunks=2, dim=0)

    loss = -F.logsigmoid(higher_end_reward - lower_end_reward).mean()

    if cfgs.train_cfgs.regularization > 0.0:
        loss = (
            loss
            + cfgs.train_cfgs.regularization
            * torch.stack([lower_end_reward, higher_end_reward]).square().mean()
        )

    accuracy = (higher_end_reward > lower_end_reward).float().mean()  # size = ()
    return {
        'loss': loss,
        'higher_end_reward': higher_end_reward,
        'lower_end_reward': lower_end_reward,
        'higher_rewards': higher_rewards,
        'lower_rewards': lower_rewards,
        'accuracy': accuracy,
        'output': output,
    }


batch = PreferenceCollator(tokenizer, tokenizer.padding_side)(samples)
lengths = batch['attention_mask'].sum(-1)
assert (lengths < batch['input_ids'].shape[1]).any()  # the batch is really padded
with torch.no_grad():
    out = loss_fn(batch)

# ---- reference: each conversation alone, unpadded ----
texts = [s['better_conversation'] for s in samples] + [s['worse_conversation'] for s in samples]
ref_end, ref_h = [], []
max_err = 0.0
for i, t in enumerate(texts):
    ids = torch.tensor([tokenizer(t, add_special_tokens=False)['input_ids']])
    assert ids[0, -1].item() == tokenizer.eos_token_id
    n = ids.shape[1]
    assert lengths[i].item() == n
    with torch.no_grad():
        h = model.model(ids).last_hidden_state[0]  # (n, E)
    s = model.score_head(h).float()  # (n, 1)
    max_err = max(max_err, (out['output'].scores[i, :n] - s).abs().max().item())
    assert out['output'].end_index[i].item() == n - 1
    ref_end.append(s[-1, 0])
    ref_h.append(h[-1])
ref_end = torch.stack(ref_end)
ref_h = torch.stack(ref_h)

assert max_err < 1e-4, max_err
end_err = (out['output'].end_scores[:, 0] - ref_end).abs().max().item()
h_err = (out['output'].end_last_hidden_state - ref_h).abs().max().item()
assert end_err < 1e-4 and h_err < 1e-4, (end_err, h_err)

B = len(samples)
terms, reg, correct = [], [], 0
for k in range(B):
    hi, lo = ref_end[k], ref_end[B + k]
    terms.append(-F.logsigmoid(hi - lo))
    reg += [hi**2, lo**2]
    correct += int(hi > lo)
ref_loss = torch.stack(terms).mean() + 0.001 * torch.stack(reg).mean()
assert abs(out['loss'].item() - ref_loss.item()) < 1e-5, (out['loss'].item(), ref_loss.item())
assert abs(out['accuracy'].item() - correct / B) < 1e-6

print(f"end_index {out['output'].end_index.tolist()} of width {batch['input_ids'].shape[1]}")
print(f"max |score - per-sequence| {max_err:.2e}, end scores {end_err:.2e}, end hidden {h_err:.2e}; "
      f"loss {out['loss'].item():.6f} == loop {ref_loss.item():.6f}")
