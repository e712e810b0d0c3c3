# huggingface/transformers#36053 ("Add Janus model"), review comment by hsilva664 (2025-03-06), fixed in the PR
# before merge: JanusForConditionalGeneration.generate in image mode doubled the batch for classifier-free
# guidance (conditional rows + unconditional rows whose text is replaced by pad) but ran the language model
# without the prompt's attention_mask, so a short prompt's left pads were attended by every image token
# ("the short prompt that gets left-padded has an output image that is simply noise").
# Fix: attention_mask = attention_mask.repeat(2, 1) is kept in model_kwargs and grown by one column per step.
# Trimmed port: the Llama language model of Janus (tiny config), the generation head, the CFG loop with a cache.
import sys

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig, LlamaModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD, BOS, BOI = 0, 1, 2
NUM_IMAGE_TOKENS = 6
IMAGE_VOCAB = 16
CFG_SCALE = 5.0

config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                     pad_token_id=PAD, bos_token_id=BOS)
config._attn_implementation = "eager"


class JanusLite(nn.Module):
    def __init__(self):
        super().__init__()
        self.language_model = LlamaModel(config)
        self.generation_embeddings = nn.Embedding(IMAGE_VOCAB, 32)
        self.generation_aligner = nn.Linear(32, config.hidden_size)
        self.generation_head = nn.Linear(config.hidden_size, IMAGE_VOCAB)

    def prepare_embeddings_for_image_generation(self, image_ids):
        return self.generation_aligner(self.generation_embeddings(image_ids))

    @torch.no_grad()
    def generate(self, input_ids, attention_mask):
        batch_size, seq_len = input_ids.shape
        input_tokens = input_ids.repeat(2, 1)  # conditional / unconditional rows
        if FIXED:
            attention_mask = attention_mask.repeat(2, 1)
        else:
            attention_mask = None
        mask = (input_tokens[batch_size:, :] != BOS) & (input_tokens[batch_size:, :] != BOI)
        input_tokens[batch_size:, :].masked_fill_(mask, PAD)
        inputs_embeds = self.language_model.get_input_embeddings()(input_tokens)

        cache = DynamicCache()
        generated_tokens = torch.zeros((batch_size, NUM_IMAGE_TOKENS), dtype=torch.long)
        past_len = 0
        for i in range(NUM_IMAGE_TOKENS):
            step = inputs_embeds.shape[1]
            cache_position = torch.arange(past_len, past_len + step)
            if attention_mask is not None:
                position_ids = attention_mask.long().cumsum(-1) - 1
                position_ids.masked_fill_(attention_mask == 0, 1)
                position_ids = position_ids[:, -step:]
            else:
                position_ids = cache_position.unsqueeze(0).expand(2 * batch_size, -1)
            outputs = self.language_model(inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                          position_ids=position_ids, cache=cache,
                                          cache_position=cache_position, use_cache=True)
            past_len += step
            if attention_mask is not None:
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones((2 * batch_size, 1))], dim=-1)
            hidden_state = outputs.last_hidden_state[:, -1, :]
            scores = self.generation_head(hidden_state)
            cond, uncond = scores.chunk(2)
            scores = uncond + CFG_SCALE * (cond - uncond)
            next_token = torch.argmax(scores, dim=-1)
            generated_tokens[:, i] = next_token
            next_token = torch.cat([next_token, next_token]).unsqueeze(-1)
            inputs_embeds = self.prepare_embeddings_for_image_generation(next_token)
        return generated_tokens, scores


model = JanusLite().eval()
# Left-padded batch: a long prompt and a short one, each ending in <begin_of_image>.
prompts = [[BOS, 7, 8, 9, 10, 11, 12, 13, BOI], [BOS, 21, 22, BOI]]
max_len = max(len(p) for p in prompts)
input_ids = torch.tensor([[PAD] * (max_len - len(p)) + p for p in prompts])
attention_mask = torch.tensor([[0] * (max_len - len(p)) + [1] * len(p) for p in prompts])

tokens, last_scores = model.generate(input_ids, attention_mask)
print("image tokens:", tokens.tolist())
print("last cfg scores row 1:", [round(v, 4) for v in last_scores[1, :4].tolist()])
