# reward-bench, allenai/reward-bench#154 (commit fd430df, "fix padding for GRM class"), rewardbench/models/grm.py.
# GRewardModel (Ray2333/GRM-Gemma-2B-sftreg) reads the reward at the last token. It decided between left and right
# padding by looking at input_ids[0][0] == pad_token_id, i.e. only at the first row. Gemma's tokenizer pads on the
# left, so when the first row of a batch is its longest prompt-response pair the check says "right padding" and the
# other rows are scored at attention_mask.sum(-1) - 1, a position inside the left padding / their prompt.
# The fix decides from the whole mask: torch.any(attention_mask[:, 0] == 0) -> left padding -> index -1 for every row.
import sys

import torch
import torch.nn as nn
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import AutoConfig, AutoModelForCausalLM, GemmaConfig, PreTrainedModel, PreTrainedTokenizerFast

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ValueHead(nn.Module):
    def __init__(self, config, **kwargs):
        super().__init__()
        if not hasattr(config, "summary_dropout_prob"):
            summary_dropout_prob = kwargs.pop("summary_dropout_prob", 0.1)
        else:
            summary_dropout_prob = config.summary_dropout_prob
        self.dropout = nn.Dropout(summary_dropout_prob) if summary_dropout_prob else nn.Identity()

        # some models such as OPT have a projection layer before the word embeddings
        if hasattr(config, "hidden_size"):
            hidden_size = config.hidden_size
        if hasattr(config, "word_embed_proj_dim"):
            hidden_size = config.word_embed_proj_dim
        elif hasattr(config, "is_encoder_decoder"):
            if config.is_encoder_decoder and hasattr(config, "decoder"):
                if hasattr(config.decoder, "hidden_size"):
                    hidden_size = config.decoder.hidden_size

        # get vhead config, where config from json first
        if hasattr(config, "vhead_layer_type"):
            self.layer_type = config.vhead_layer_type
        else:
            self.layer_type = kwargs.pop("vhead_layer_type", "mlp")
        if hasattr(config, "vhead_num_neurons"):
            num_neurons = config.vhead_num_neurons
        else:
            num_neurons = kwargs.pop("vhead_num_neurons", 1024)
        if hasattr(config, "vhead_num_layers"):
            num_layers = config.vhead_num_layers
        else:
            num_layers = kwargs.pop("vhead_num_layers", 1)

        if self.layer_type == "linear":
            self.summary = nn.Linear(hidden_size, 1)
        else:
            module_lis = []
            input_neurons = hidden_size
            for i in range(num_layers):
                module_lis.extend([nn.Linear(input_neurons, num_neurons), nn.ReLU()])
                input_neurons = num_neurons

            module_lis.append(nn.Linear(num_neurons, 1))
            self.summary = nn.Sequential(*module_lis)
        self.flatten = nn.Flatten()

    def forward(self, hidden_states):
        output = self.dropout(hidden_states)
        if self.layer_type == "linear" and output.dtype != self.summary.weight.dtype:
            output = output.to(self.summary.weight.dtype)
        elif self.layer_type != "linear" and output.dtype != self.summary[0].weight.dtype:
            output = output.to(self.summary[0].weight.dtype)

        output = self.summary(output)
        return output


class GRewardModel(PreTrainedModel):
    config_class = AutoConfig
    _no_split_modules = []

    def __init__(self, config):
        super().__init__(config)
        model = AutoModelForCausalLM.from_config(config)
        self.model = model.model
        self.v_head = ValueHead(self.model.config)

    def forward(
        self,
        input_ids=None,
        past_key_values=None,
        attention_mask=None,
        **kwargs,
    ):
        kwargs["output_hidden_states"] = True
        kwargs["past_key_values"] = past_key_values

        base_model_output = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            **kwargs,
        )
        last_hidden_state = base_model_output.hidden_states[-1]

        if hasattr(self.v_head.summary, "weight") and last_hidden_state.device != self.v_head.summary.weight.device:
            last_hidden_state = last_hidden_state.to(self.v_head.summary.weight.device)
        elif not hasattr(self.v_head.summary, "weight") and (
            last_hidden_state.device != self.v_head.summary[0].weight.device
        ):
            last_hidden_state = last_hidden_state.to(self.v_head.summary[0].weight.device)

        # use the last token value as reward
        if FIXED:
            left_padded = torch.any(attention_mask[:, 0] == 0)
        else:
            left_padded = input_ids[0][0].item() == self.config.pad_token_id
        if left_padded:
            # left padding
            last_index = attention_mask.shape[-1] - 1
        else:
            # right padding
            last_index = attention_mask.sum(dim=-1) - 1
        value = self.v_head(last_hidden_state).squeeze(-1)[torch.arange(len(last_hidden_state)), last_index]
        return value


class GRMPipeline:
    def __init__(self, task, model, tokenizer):
        self.task = task
        self.model = model
        self.tokenizer = tokenizer

    def __call__(self, samples, **kwargs):
        _ = kwargs.get("batch_size", 1)
        truncation = kwargs.get("truncation", True)
        padding = kwargs.get("padding", True)
        max_length = kwargs.get("max_length", 2048)
        inputs = self.tokenizer(
            samples,
            truncation=truncation,
            max_length=max_length,
            padding=padding,
            return_tensors="pt",
        ).to("cpu")
        with torch.no_grad():
            outputs = self.model(**inputs)
        return outputs


def build_gemma_like_tokenizer():
    # A word-level stand-in for the Gemma tokenizer: <pad>=0, <eos>=1, <bos>=2, BOS prepended, left padding.
    words = ("user model what is two plus two three four five the answer sky colour blue green red "
             "it write a poem about sea waves sand sun").split()
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        padding_side="left",
    )


tokenizer = build_gemma_like_tokenizer()
config = GemmaConfig(
    vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=2,
)
config.vhead_layer_type = "mlp"
config.vhead_num_neurons = 16
config.vhead_num_layers = 1
config.summary_dropout_prob = 0.0
model = GRewardModel(config).eval()
reward_pipe = GRMPipeline("text-classification", model=model, tokenizer=tokenizer)

# For models whose config did not contains `pad_token_id`
if reward_pipe.model.config.pad_token_id is None:
    reward_pipe.model.config.pad_token_id = reward_pipe.tokenizer.pad_token_id

reward_pipeline_kwargs = {"batch_size": 3, "truncation": True, "padding": True, "max_length": 64}
dataset = [
    {"text_chosen": "user write a poem about the sea model waves sand sun sea waves sand blue sky",
     "text_rejected": "user write a poem about the sea model the sea is red"},
    {"text_chosen": "user what is two plus two model four",
     "text_rejected": "user what is two plus two model five"},
    {"text_chosen": "user the sky colour model blue",
     "text_rejected": "user the sky colour model green"},
]

results, scores_chosen, scores_rejected = [], [], []
batch = {k: [ex[k] for ex in dataset] for k in ("text_chosen", "text_rejected")}
rewards_chosen = reward_pipe(batch["text_chosen"], **reward_pipeline_kwargs)
rewards_rejected = reward_pipe(batch["text_rejected"], **reward_pipeline_kwargs)
score_chosen_batch = rewards_chosen.cpu().numpy().tolist()
score_rejected_batch = rewards_rejected.cpu().numpy().tolist()
[results.append(1) if chosen > rejected else results.append(0)
 for chosen, rejected in zip(score_chosen_batch, score_rejected_batch)]
scores_chosen.extend(score_chosen_batch)
scores_rejected.extend(score_rejected_batch)

print("scores_chosen:", [round(s, 5) for s in scores_chosen])
print("scores_rejected:", [round(s, 5) for s in scores_rejected])
print("results:", results, "accuracy:", sum(results) / len(results))
