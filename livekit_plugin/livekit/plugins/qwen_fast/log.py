# Copyright 2026 pipecat-qwen-fast authors
# SPDX-License-Identifier: Apache-2.0

import logging

logger = logging.getLogger("livekit.plugins.qwen_fast")
