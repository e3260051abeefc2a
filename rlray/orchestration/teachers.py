"""The distillation teacher pool (algo.loss=opd): started with the run, watched, replaced when lost.

Contract: `TeacherPool(config, handles)` drives the `teacher-i` actors that rlray.orchestration.cluster
spawned. `start()` starts their engines, hands them to the buffer (which sends them each arriving
group to score) and watches each (`TeacherActor.watch`). `heal()` replaces, in its bundle, every
teacher whose engine or process died (up to `teacher.max_restarts` in all, then a one-line
RuntimeError), hands the buffer the new set and returns how many it replaced; the groups whose
scoring failed meanwhile were dropped and counted by the buffer. `check_tokenizer(student, teacher)`
refuses, in one line, a teacher whose tokenizer is not the student's (scores of other ids would be
meaningless).
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import RayError

from rlray.actors.rollout import one_line
from rlray.config import Config, ConfigError
from rlray.orchestration import cluster


def check_tokenizer(student_path: str, teacher_name: str) -> None:
    from transformers import AutoTokenizer

    try:
        teacher = AutoTokenizer.from_pretrained(teacher_name)
    except (OSError, ValueError) as e:
        raise ConfigError(f"teacher.name='{teacher_name}': no tokenizer loads from it ({one_line(e, 160)}); give "
                          "a model folder (a run's exported hf/) or an HF id this machine can read") from None
    student = AutoTokenizer.from_pretrained(student_path)
    if teacher.get_vocab() != student.get_vocab() or teacher.eos_token_id != student.eos_token_id:
        raise ConfigError(f"teacher.name='{teacher_name}' has another tokenizer than the student ({len(teacher)} vs "
                          f"{len(student)} tokens, eos {teacher.eos_token_id} vs {student.eos_token_id}): the teacher "
                          "scores the student's token ids, so both must share one tokenizer; pick a teacher of the "
                          "student's family")


class TeacherPool:
    def __init__(self, c: Config, handles: cluster.Handles) -> None:
        self.c, self.h = c, handles
        self.restarts = 0
        self.incarnations = [0] * len(handles.teachers)
        self.watches: list[Any] = []

    def names(self) -> list[str]:
        return [cluster.actor_name("teacher", i, n) for i, n in enumerate(self.incarnations)]

    def start_refs(self) -> list[Any]:
        """The engines' start calls (the controller waits for them with the other actors')."""
        return [t.start.remote() for t in self.h.teachers]

    def start(self) -> None:
        """After `start_refs` completed: the buffer gets the teachers, each is watched."""
        self.watches = [t.watch.remote() for t in self.h.teachers]
        self.attach()

    def attach(self) -> None:
        """Hand the teachers to the buffer (again, when the buffer was re-created)."""
        ray.get(self.h.buffer.set_teachers.remote([cluster.TeacherClient(t) for t in self.h.teachers]))

    def _lost(self) -> dict[int, str]:
        ready, _ = ray.wait(self.watches, num_returns=len(self.watches), timeout=0)
        lost = {}
        for i, ref in enumerate(self.watches):
            if ref in ready:
                try:
                    lost[i] = ray.get(ref, timeout=0)
                except RayError as e:
                    lost[i] = f"its process died ({one_line(getattr(e, 'cause', None) or e, 160)})"
        return lost

    def heal(self) -> int:
        lost = self._lost()
        if not lost:
            return 0
        names, te = self.names(), self.c.teacher
        what = "; ".join(f"{names[i]} was lost: {why}" for i, why in sorted(lost.items()))
        if self.restarts + len(lost) > te.max_restarts:
            raise RuntimeError(f"{what}. teacher.max_restarts={te.max_restarts} allows no more replacements "
                               f"({self.restarts} used): raise it, or fix the cause and resume the run")
        t0 = time.perf_counter()
        print(f"{what}; replacing it", flush=True)
        self.restarts += len(lost)
        for i in lost:
            ray.kill(self.h.teachers[i], no_restart=True)
            self.incarnations[i] = self.restarts
            assert self.h.teacher_pg is not None
            self.h.teachers[i] = cluster.spawn_teacher(self.c, i, self.h.teacher_pg, self.restarts)
        ray.get([self.h.teachers[i].start.remote() for i in lost])
        for i in lost:
            self.watches[i] = self.h.teachers[i].watch.remote()
        self.attach()
        print(f"{', '.join(self.names()[i] for i in sorted(lost))} started in {time.perf_counter() - t0:.1f}s "
              f"({self.restarts} of teacher.max_restarts={te.max_restarts} used)", flush=True)
        return len(lost)
