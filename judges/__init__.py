"""Judges: from a turn and its next state to a reward and a hindsight hint (docs/design.md#judges).

    PRMJudge    m votes of a judge model, \\boxed{1|0|-1}, majority (tie: 0)
    HintJudge   m votes: a hint between [HINT_START]...[HINT_END], or a decline
    RulesJudge  offline default: explicit corrections (-1, the correction as hint) and thanks (+1)
    Teacher     the hinted prompt scored on the student's tokens (OPD), and a hint scorer
"""

from clawbridge.judges.clients import (
    BackendJudgeClient,
    JudgeClient,
    JudgeError,
    OpenAIJudgeClient,
    TransientJudgeError,
)
from clawbridge.judges.factory import Judges, build_judges
from clawbridge.judges.hints import HintJudge, teacher_messages, teacher_view
from clawbridge.judges.prm import PRMJudge
from clawbridge.judges.rules import RulesJudge
from clawbridge.judges.teacher import Teacher
from clawbridge.judges.types import (
    HintJudgment,
    HintSource,
    HintVote,
    Judgment,
    RewardJudge,
    TurnContext,
    Vote,
)

__all__ = [
    "BackendJudgeClient",
    "HintJudge",
    "HintJudgment",
    "HintSource",
    "HintVote",
    "JudgeClient",
    "JudgeError",
    "Judges",
    "Judgment",
    "OpenAIJudgeClient",
    "PRMJudge",
    "RewardJudge",
    "RulesJudge",
    "Teacher",
    "TransientJudgeError",
    "TurnContext",
    "Vote",
    "build_judges",
    "teacher_messages",
    "teacher_view",
]
