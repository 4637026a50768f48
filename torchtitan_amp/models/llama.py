"""Former home of the Llama 3 model, now models/llama3/model.py. Kept as an alias of that module
(the same module object, so registering into LLAMA3_FLAVORS or monkeypatching here reaches the
family) because tests, benchmarks and users' scripts import `torchtitan_amp.models.llama`."""

import sys

from torchtitan_amp.models.llama3 import model as _model

sys.modules[__name__] = _model
