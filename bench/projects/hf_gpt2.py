"""A tiny Transformers GPT-2 built from a config (no hub): its forward returns a `ModelOutput` whose
`.loss` is the objective; samples are dicts of `input_ids` and `labels` over the stdlib's bytes."""

import inspect
import json

import torch
from torch import nn
from torch.utils.data import Dataset


def build() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


class ByteWindows(Dataset):
    def __init__(self, split: str, block: int = 32) -> None:
        data = torch.tensor(list(inspect.getsource(json).encode() * 4), dtype=torch.long)
        cut = int(0.9 * len(data))
        self.data, self.block = (data[:cut] if split == "train" else data[cut:]), block

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.data[i * self.block:(i + 1) * self.block]
        return {"input_ids": ids, "labels": ids}  # GPT-2 shifts the labels itself


def data(split: str) -> Dataset:
    return ByteWindows(split)
