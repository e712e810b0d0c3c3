"""verl SFT (FSDPSFTTrainer + MultiTurnSFTDataset): the loss mask is sliced one token off.

Citation: verl-project/verl#3287 (commit 2d6c6dbb3, "[trainer] fix: Correct off-by-one error in SFT loss mask
slicing"), verl/trainer/fsdp_sft_trainer.py `_compute_loss_and_backward`; dataset side ported from
verl/utils/dataset/multiturn_sft_dataset.py at 2d6c6dbb3^ (`_process_message_tokens`, `__getitem__`).

MultiTurnSFTDataset gives each token its own loss flag (1 on the assistant's reply tokens, 0 on the generation prompt
`<|im_start|>assistant\n`, user turns and right padding).  The trainer shifts logits and labels by one
(`logits[..., :-1]` scores `input_ids[:, 1:]`) but took `loss_mask[:, :-1]`, i.e. the flag of the *input* token rather
than of the label token: the first token of every reply is never trained, and the last reply token of the
conversation is trained to predict the first pad token.  The fix slices `loss_mask[:, 1:]`.
"""
import sys

import torch
import torch.nn as nn
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

FIXED = "--fixed" in sys.argv

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(texts):
    words = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "\n", " ", "system", "user", "assistant", "tool"]
    for t in texts:
        for w in t.split():
            if w not in words:
                words.append(w)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n| |[^ \n]+"), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.chat_template = CHATML
    return tokenizer


class MultiTurnSFTDataset(torch.utils.data.Dataset):
    def __init__(self, messages, tokenizer, max_length, truncation="error"):
        self.messages = messages
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.truncation = truncation
        self.tools = None
        self.enable_thinking = None
        self.apply_chat_template_kwargs = {}

    def __len__(self):
        return len(self.messages)

    def _process_message_tokens(self, messages, start_idx, end_idx, is_assistant=False, enable_thinking=None,
                                tools=None):
        if start_idx > 0:
            prev_applied_text = self.tokenizer.apply_chat_template(
                messages[:start_idx], tokenize=False, add_generation_prompt=False, enable_thinking=enable_thinking,
                tools=tools, **self.apply_chat_template_kwargs,
            )
            if is_assistant:
                prev_applied_text_w_generation_prompt = self.tokenizer.apply_chat_template(
                    messages[:start_idx], tokenize=False, add_generation_prompt=True,
                    enable_thinking=enable_thinking, tools=tools, **self.apply_chat_template_kwargs,
                )
        else:
            prev_applied_text = ""

        cur_applied_text = self.tokenizer.apply_chat_template(
            messages[:end_idx], tokenize=False, add_generation_prompt=False, enable_thinking=enable_thinking,
            tools=tools, **self.apply_chat_template_kwargs,
        )
        if is_assistant:
            generation_prompt_text = prev_applied_text_w_generation_prompt[len(prev_applied_text):]
            generation_prompt_tokens = self.tokenizer.encode(generation_prompt_text, add_special_tokens=False)
            _message_tokens = self.tokenizer.encode(
                cur_applied_text[len(prev_applied_text_w_generation_prompt):], add_special_tokens=False
            )
            message_tokens = generation_prompt_tokens + _message_tokens
            loss_mask = [0] * (len(generation_prompt_tokens)) + [1] * (
                len(message_tokens) - len(generation_prompt_tokens)
            )
        else:
            message_tokens = self.tokenizer.encode(cur_applied_text[len(prev_applied_text):],
                                                   add_special_tokens=False)
            loss_mask = [0] * len(message_tokens)

        attention_mask = [1] * len(message_tokens)
        return message_tokens, loss_mask, attention_mask

    def __getitem__(self, item):
        tokenizer = self.tokenizer
        messages = self.messages[item]
        tools = None
        enable_thinking = None

        full_tokens = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=True, return_tensors="pt", add_generation_prompt=False,
            enable_thinking=enable_thinking, **self.apply_chat_template_kwargs,
        )
        if not torch.is_tensor(full_tokens):  # newer transformers return a BatchEncoding here
            full_tokens = full_tokens["input_ids"]

        concat_tokens, concat_loss_mask, concat_attention_mask = [], [], []
        i = 0
        while i < len(messages):
            role = messages[i]["role"]
            if role == "assistant":
                tokens, loss_mask, attention_mask = self._process_message_tokens(
                    messages, i, i + 1, is_assistant=True, enable_thinking=enable_thinking, tools=tools
                )
                i += 1
            elif role in ["user", "system"]:
                tokens, loss_mask, attention_mask = self._process_message_tokens(
                    messages, i, i + 1, enable_thinking=enable_thinking, tools=tools
                )
                i += 1
            else:
                raise ValueError(f"Unknown role: {role}")
            concat_tokens.extend(tokens)
            concat_loss_mask.extend(loss_mask)
            concat_attention_mask.extend(attention_mask)

        if concat_tokens != full_tokens[0].tolist():
            input_ids = torch.tensor(concat_tokens, dtype=torch.long)
        else:
            input_ids = full_tokens[0]
        loss_mask = torch.tensor(concat_loss_mask, dtype=torch.long)
        attention_mask = torch.tensor(concat_attention_mask, dtype=torch.long)

        sequence_length = input_ids.shape[0]
        if sequence_length < self.max_length:
            pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            padded_input_ids = torch.full((self.max_length - sequence_length,), pad_token_id, dtype=input_ids.dtype)
            padded_attention_mask = torch.zeros((self.max_length - sequence_length,), dtype=attention_mask.dtype)
            padded_loss_mask = torch.zeros((self.max_length - sequence_length,), dtype=loss_mask.dtype)
            input_ids = torch.cat((input_ids, padded_input_ids))
            attention_mask = torch.cat((attention_mask, padded_attention_mask))
            loss_mask = torch.cat((loss_mask, padded_loss_mask))
        elif sequence_length > self.max_length:
            raise ValueError(f"{sequence_length=} is larger than {self.max_length=}")

        position_ids = torch.arange(len(input_ids), dtype=torch.long)
        position_ids = position_ids * attention_mask

        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "loss_mask": loss_mask,
        }


class FSDPSFTTrainer:
    def __init__(self, model, device_name="cpu"):
        self.fsdp_model = model
        self.model = model
        self.device_name = device_name

    def _compute_loss_and_backward(self, batch, do_backward=True):
        input_ids = batch["input_ids"].to(self.device_name)
        attention_mask = batch["attention_mask"].to(self.device_name)
        position_ids = batch["position_ids"].to(self.device_name)
        if FIXED:
            loss_mask = batch.pop("loss_mask")[:, 1:].reshape(-1).to(self.device_name)
        else:
            loss_mask = batch.pop("loss_mask")[:, :-1].reshape(-1).to(self.device_name)
        loss_fct = nn.CrossEntropyLoss(reduction="none")

        labels = input_ids[:, 1:].contiguous()
        output = self.fsdp_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        logits = output.logits

        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels.contiguous()
        shift_logits = shift_logits.view(-1, self.model.config.vocab_size)
        shift_labels = shift_labels.view(-1)
        shift_labels = shift_labels.to(shift_logits.device)
        loss = loss_fct(shift_logits, shift_labels)
        loss = loss * loss_mask.to(loss.device)

        valid_token_this_rank = torch.sum(loss_mask)
        dp_size = 1
        loss = torch.sum(loss) / (valid_token_this_rank + 1e-8) * dp_size
        if do_backward:
            loss.backward()
        return loss


def main():
    torch.manual_seed(0)
    conversations = [
        [
            {"role": "system", "content": "you are a helpful assistant"},
            {"role": "user", "content": "what is two plus three"},
            {"role": "assistant", "content": "two plus three is five"},
            {"role": "user", "content": "and times four"},
            {"role": "assistant", "content": "five times four is twenty"},
        ],
        [
            {"role": "user", "content": "name a red fruit"},
            {"role": "assistant", "content": "an apple is a red fruit"},
        ],
    ]
    texts = [m["content"] for conv in conversations for m in conv]
    tokenizer = build_tokenizer(texts)
    dataset = MultiTurnSFTDataset(conversations, tokenizer, max_length=80)
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, shuffle=False)
    batch = next(iter(loader))

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id, attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config)
    trainer = FSDPSFTTrainer(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    losses = []
    for step in range(3):
        optimizer.zero_grad()
        loss = trainer._compute_loss_and_backward(dict(batch))
        optimizer.step()
        losses.append(loss.item())
    print("sft losses:", [round(x, 5) for x in losses])

    # first reply token after a generation prompt: log-prob the model gives it after training
    model.eval()
    prompt = tokenizer.apply_chat_template(conversations[1][:1], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0, -1].log_softmax(-1)
    first = tokenizer.convert_tokens_to_ids("an")
    print("log p(first reply token):", round(logp[first].item(), 5))


if __name__ == "__main__":
    main()
