"""`FineTuner`: executes a `Plan` with a small, explicit training loop on accelerate.

Read it top to bottom, as it runs: `run` sets up (processes once; then seed,
model, optimizer, schedule, data) and evaluates the base model; each optimizer
step takes its rows in micro-batches, normalises the loss by the trained
tokens of the whole step (any split gives the same update), checks it is
finite, clips, steps, logs, evaluates now and then (eval loss and forgetting,
`general_text`), and checkpoints every `save_every` steps. The best evaluation
within the forgetting limit has its weights kept at once (`best_weights`),
which become `adapter/` at the end. `Position`, where the loop is, is saved in every checkpoint.

A training step's failures (out of memory, non-finite loss) are caught in
`_attempt` and go to the `TrainingRecoverySystem`, which returns a changed
plan; the loop rolls back to the last checkpoint and carries on. Out of memory
while evaluating is caught in `evaluation.Evaluation`, which lowers the
micro-batch and evaluates again. Anything else ends the run in `run`, with
status.json saying why. SIGINT and SIGTERM stop at the next micro-batch (the
unfinished step is dropped) with a checkpoint of the last finished step.
What depends on the number of processes is in `processes.Processes`.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict
from typing import Any, Callable

import torch

from llmcustoms.losses.choice import loss_for
from llmcustoms.losses.objective import LoopParts, Loss
from llmcustoms.models.loading import load_model
from llmcustoms.models.untrained_tokens import check_stop_tokens
from llmcustoms.planning.plan import Plan
from llmcustoms.recovery.faults import SPIKE_FACTOR, FaultInjector
from llmcustoms.recovery.recovery_system import RestartNeeded, TrainingFailed, TrainingInterrupted, TrainingRecoverySystem
from llmcustoms.recovery.stability import StabilityCheck
from llmcustoms.recovery.stop_signals import StopRequested, StopSignals, record_quit, stopped_by
from llmcustoms.reporting import Reporter, SilentReporter
from llmcustoms.runs.best_weights import BestWeights
from llmcustoms.runs.checkpoints import Checkpoint, CheckpointManager, ResumeFrom, rng_state, set_rng_state
from llmcustoms.runs.run_directory import RunDirectory
from llmcustoms.training.batching import Rows, StepRows, TrainingRows, epoch_steps, pad_multiple
from llmcustoms.training.evaluation import Evaluation
from llmcustoms.training.general_text import general_rows
from llmcustoms.training.optimization import Schedule, lr_multiplier, make_optimizer, set_learning_rate
from llmcustoms.training.position import Position, RunPace, StopCause, StopReason, TrainResult
from llmcustoms.training.processes import Processes
from llmcustoms.training.replay import mix_in
from llmcustoms.training.resource_use import ResourceUse
from llmcustoms.training.samples import SampleReplies, side_by_side
from llmcustoms.training.step import accumulate_gradients

# status.json is rewritten (with fsync) at most this often while training runs.
STATUS_INTERVAL_S = 5.0


class FineTuner:
    def __init__(self, plan: Plan, tokenizer: Any, train: Rows, evaluation: Rows,
                 run_dir: RunDirectory, reporter: Reporter, faults: FaultInjector | None = None,
                 on_evaluate: Callable[[int, float], bool] | None = None, save_artifacts: bool = True,
                 loss: Loss | None = None, steps: StepRows = epoch_steps,
                 schedule: Schedule = lr_multiplier, samples: SampleReplies | None = None, baseline: bool = True):
        """`on_evaluate(step, eval_loss)` may return True to stop (tuning prunes
        this way); `save_artifacts=False` writes no checkpoints and no adapter;
        `samples` answers sample prompts; `baseline=False` skips evaluating the
        base model. `loss` (a `losses.objective.Loss`; default: the plan's objective's), `steps(lengths,
        step_rows, seed, epoch)` (an epoch's steps, as row indices) and `schedule(step, plan)` replace the defaults."""
        self.plan, self.tokenizer, self.run_dir, self.reporter = plan, tokenizer, run_dir, reporter
        self.faults = faults or FaultInjector.from_env()
        self.on_evaluate, self.save_artifacts, self.samples, self.baseline = on_evaluate, save_artifacts, samples, baseline
        self.loss, self.steps, self.schedule = loss or loss_for(plan), steps, schedule
        # Lengths rounded up for tensor cores, or to bound the kernels a CPU in bf16 keeps (`pad_multiple`).
        self.data = TrainingRows(train, evaluation, tokenizer.pad_token_id, pad_multiple(plan),
                                 packing=plan.packing, general=general_rows(tokenizer, plan))
        self.data.cut(plan.max_seq_len)  # a resumed run whose recovery shortened sequences
        self.recovery, self.stability = TrainingRecoverySystem(), StabilityCheck()
        self.checkpoints = CheckpointManager(run_dir.checkpoints_path, plan.keep_checkpoints,
                                             warn=lambda text: reporter.message(text, warning=True), point=self.faults.kill_saving,
                                             check=lambda c: self.processes.checkpoint_problem(c, self.model, self.optimizer))
        # Without artifacts (tuning trials) a second Ctrl-C reaches the caller as KeyboardInterrupt (it sums the study up).
        self.signals = StopSignals(lambda text: self.reporter.message(text, warning=True), save_artifacts,
                                   lambda signum: record_quit(self.run_dir, signum, self.position.step, self.checkpoints))
        self.position = Position()
        self.saved_step = -1  # the step of the last checkpoint this process wrote
        self.trained_since = time.monotonic()  # when the training since the last evaluation began

    def run(self, resume: bool | ResumeFrom = False) -> TrainResult:
        """Set up, train, save. Ends with a result, or with TrainingFailed,
        TrainingInterrupted or RestartNeeded once status.json says so."""
        self._setup_processes()
        self._setup_training()
        if resume:
            self._resume(ResumeFrom() if resume is True else resume)
            self.stability.seed(self.run_dir.read_metrics())  # the spikes are judged against the steps before
        self.run_dir.write_status("running", step=self.position.step, total_steps=self.plan.total_steps, reason=None,
                                  suggestions=None)
        started, tokens_at_start = time.perf_counter(), self.position.tokens
        self.usage.restart()  # the rows measure training: loading the model peaks higher on some machines
        with self.signals:
            self.reporter.training_started(self.plan.total_steps, self.position.step, self.plan.memory)
            try:
                stop = self._train()
            except TrainingFailed as failed:
                self.run_dir.write_status("failed", step=self.position.step, reason=failed.report["reason"],
                                          suggestions=failed.report["suggestions"], memory=self.usage.comparison())
                raise
            except RestartNeeded as restart:
                self.run_dir.write_status("failed", step=self.position.step, reason=restart.reason)
                raise
            except TrainingInterrupted:
                raise  # status.json already says so
            except Exception as error:
                raise self.processes.failure(error, self.run_dir, self.plan, self.position.step) from error
            finally:
                self.reporter.training_finished()
                self.usage.close()
            return self._finish(stop, time.perf_counter() - started, self.position.tokens - tokens_at_start)

    # ------------------------------------------------------------------ setup

    def _setup_processes(self) -> None:
        """Once per run: a rollback keeps them. `Processes` keeps the writable run
        directory (any rank may leave a restart request); the loop writes only from the main one."""
        self.processes = Processes.start(self.plan, self.run_dir, self.signals)
        self.accelerator, self.device = self.processes.accelerator, self.processes.device
        # Before the model loads: on a CPU, the resident size the training's memory is counted from.
        self.usage = ResourceUse.start(self.device, self.plan, self.run_dir.read_status())
        self.evaluation = Evaluation(self.data, self.processes, self.loss, self._loss, self._free_memory,
                                     lambda text: self.reporter.activity(text))
        self.faults.rank = self.processes.rank
        if not self.processes.is_main:
            self.run_dir = RunDirectory(self.run_dir.path, writable=False)
            self.reporter = SilentReporter()  # one progress display, from the main process
        self.best = BestWeights(self.run_dir, self.checkpoints, self.processes, self.plan,
                                lambda text: self.reporter.message(text, warning=True))

    def _setup_training(self) -> None:
        """What a rollback to step 0 sets up again."""
        from accelerate.utils import set_seed

        set_seed(self.plan.seed)  # the same LoRA init on every rank; dropout draws from these too
        self._setup_model()
        self._setup_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer.optimizer,
                                                           lambda step: self.schedule(step, self.plan))
        self.evaluation.use_micro_batch(self.plan.micro_batch_size)

    def _setup_model(self) -> None:
        device_index = self.accelerator.local_process_index if torch.cuda.is_available() else None
        self.reporter.activity("loading the model")
        model = load_model(self.plan, device_index)
        if self.save_artifacts:  # a run's, not each tuning trial's; before sharding splits the embeddings
            check_stop_tokens(model, self.tokenizer, self.plan, self.run_dir, lambda t: self.reporter.message(t, warning=True))
        self.model = self.processes.place(model, self.plan, self.reporter.message)
        model = self.accelerator.unwrap_model(self.model)
        self.loss.setup(model, LoopParts(self.plan, self.data, self.run_dir, self.processes, self.accelerator.autocast,
                                         self.reporter.activity))
        self.steps = mix_in(self.data, self.steps, model, self.tokenizer, self.plan, self.run_dir,  # `--replay`
                            lambda t: self.reporter.message(t, warning=True), self.reporter.activity, self.processes.stop_now)
        # Out-of-memory injection happens inside a forward pass, after the
        # embeddings: `oom` in a training step's, `eval_oom` in an evaluation's.
        model.get_input_embeddings().register_forward_hook(
            lambda module, *_: self.faults.in_forward(self.position.step, module.training))

    def _setup_optimizer(self) -> None:
        self.optimizer = self.accelerator.prepare_optimizer(make_optimizer(self.model, self.plan))
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]

    def _resume(self, start: ResumeFrom) -> None:
        checkpoint = self.checkpoints.latest() if start.step is None else self.checkpoints.verified(start.step)
        if checkpoint is None:
            self.reporter.message("no usable checkpoint: starting from step 0", warning=True)
            self._forget_after(-1)  # from the start: the base model is evaluated again
            return
        self._restore(checkpoint, with_optimizer=not start.reset_optimizer)
        self.reporter.message(start.went_on(self.position, self.checkpoints, self.processes.is_main, self.plan.total_steps))

    # ------------------------------------------------------------------- loop

    def _train(self) -> StopReason | None:
        """Optimizer steps until the plan's last one, or a reason to stop early."""
        status_written = time.monotonic()
        # Resumed where a stop cut an evaluation short: that step's work is finished first (its checkpoint written again).
        stop = self._after_step(True) if self.evaluation.cut_short(self.position.step, self.plan, self.run_dir) else None
        if self.baseline and self.position.step == 0 and self.position.base_eval is None:
            self._evaluate_base()
        epoch, steps = None, []  # an epoch's steps, worked out once per epoch (a rollback may change it)
        while self.position.step < self.plan.total_steps and stop is None:
            if epoch != self.position.epoch:
                epoch = self.position.epoch
                steps = self.steps(self.data.lengths, self.plan.effective_batch_size, self.plan.seed, epoch)
            if self.position.index >= len(steps):
                self.position.next_epoch()
                continue
            metrics, failure = self._attempt(steps[self.position.index])
            if failure == "stopped":
                self._stop_if_signalled(saved=self.saved_step == self.position.step, last=False)
            if failure is not None:
                self._recover(failure)  # rolled back: the position is the checkpoint's
                continue
            self._record(metrics, len(steps))
            stop = self._after_step()
            if time.monotonic() - status_written > STATUS_INTERVAL_S:
                self.run_dir.write_status("running", step=self.position.step, memory=self.usage.comparison())
                status_written = time.monotonic()
        return stop

    def _after_step(self, resumed: bool = False) -> StopReason | None:
        """Evaluate when due, keep the best weights, checkpoint, stop for a signal; `resumed`: see `_train`."""
        stop = self._maybe_evaluate()
        last = self.position.step == self.plan.total_steps or stop is not None
        # An evaluation that beat the best: its weights are kept now (for full fine-tuning, as a checkpoint).
        best = self.save_artifacts and self.best.keep_if_best(self.model, self.position)
        saved = self.save_artifacts and (resumed or best or last or self.position.step % self.plan.save_every == 0)
        if saved:
            self._save_checkpoint()
        self.faults.send_signal_if_due(self.position.step)
        self._stop_if_signalled(saved, last)
        return stop

    def _attempt(self, rows: list[int]) -> tuple[dict[str, float] | None, str | None]:
        """One optimizer step, or the kind of failure that prevented it.

        The only place a training step's failure is caught. The exception is
        dropped before memory is freed: its traceback holds the step's tensors.
        """
        started, generators = time.perf_counter(), rng_state()
        failure = None
        try:
            totals, tokens, widest = self._forward_backward(rows)
        except torch.OutOfMemoryError:
            failure = "oom"
        except StopRequested:  # the step is dropped, as if never begun: a resumed run repeats it exactly
            self.optimizer.zero_grad(set_to_none=True)
            set_rng_state(*generators)
            return None, "stopped"
        if failure is not None:
            self._free_memory()
            self.processes.restart_if_sharded(failure, self.position.step + 1)
        failure = self.processes.agree(failure)
        if failure == "oom":
            self._free_memory()  # also on the ranks that did not run out themselves
            return None, failure
        totals = self.processes.sum_gradients(self.trainable, totals)
        max_norm = self.plan.max_grad_norm if self.plan.max_grad_norm > 0 else float("inf")
        grad_norm = self.processes.whole(self.accelerator.clip_grad_norm_(self.trainable, max_norm))
        # The one host sync per step: loss, the loss's sums and gradient norm come back
        # together. All are the same on every rank, so every rank takes the same decision.
        loss_value, *sums, norm_value = torch.cat([totals.float(), grad_norm.float().reshape(1).to(totals.device)]).tolist()
        failure = self.stability.judge(self.position.step + 1, loss_value, norm_value)  # NaN, or a spike
        if failure is not None:
            self.optimizer.zero_grad(set_to_none=True)  # skip the update
            return None, failure
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - started
        return {"loss": loss_value, "grad_norm": norm_value, "lr": lr, "tokens": tokens, "batch_tokens": widest,
                "tokens_per_s": tokens / elapsed, "seconds": elapsed,
                **self.loss.step_metrics(sums, len(rows))}, None

    def _forward_backward(self, rows: list[int]) -> tuple[torch.Tensor, int, int]:
        """Local gradients of this rank's share of a step; ([summed loss, its sums...], the step's input
        tokens, its largest micro-batch in padded tokens: what memory grows with)."""
        packed_to = self.plan.max_seq_len if self.data.packing else 0
        batches = [(self.data.collate(b), weight) for b, weight in
                   self.processes.micro_batches(rows, self.data.lengths, self.plan.micro_batch_size, packed_to)]
        # The whole step's trained tokens (pairs, for DPO), over every rank: each rank knows all rows.
        loss_units, input_tokens = self.data.token_counts(rows)
        normaliser = torch.tensor(max(1, loss_units), device=self.device)
        totals = accumulate_gradients(self.model, self.loss, batches, normaliser, self.device, self.accelerator.autocast,
                                      lambda loss: self.accelerator.backward(loss * self.processes.backward_scale),
                                      before=self._raise_if_stopping, alter=self._injected)
        return totals, input_tokens, max((mb["input_ids"].numel() for mb, _ in batches), default=0)

    def _raise_if_stopping(self) -> None:
        if self.processes.stop_now():
            raise StopRequested

    def _injected(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss as fault injection makes it: NaN, or a spike (`nan@N`, `spike@N`)."""
        if self.faults.due("nan", self.position.step + 1):
            return loss * float("nan")
        if self.faults.due("spike", self.position.step + 1):
            return loss * SPIKE_FACTOR
        return loss

    def _loss(self, batch: dict[str, torch.Tensor], normaliser: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        with self.accelerator.autocast():
            return self.loss(self.model, batch, normaliser)

    def _free_memory(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _record(self, metrics: dict[str, float], steps_in_epoch: int) -> None:
        position = self.position
        position.advance(metrics["tokens"], metrics["loss"])
        row = {"step": position.step, "epoch": round(position.epoch + position.index / steps_in_epoch, 4),
               **{k: v for k, v in metrics.items() if k != "tokens"}, **self.usage.row(metrics["batch_tokens"])}
        self.run_dir.append_metrics(row)
        self.reporter.step(row)

    # ------------------------------------------------------------- evaluation

    def _maybe_evaluate(self) -> StopReason | None:
        """Evaluate when due; says why to stop when it is time to."""
        plan, position = self.plan, self.position
        if not self.evaluation.due(position.step, plan):
            return None
        eval_loss = self.evaluation.loss(self.model, position.step, self._lower_evaluation_micro_batch,
                                         lambda: self._stop_if_signalled(saved=False, last=False))
        position.last_eval = eval_loss
        self._record_eval(eval_loss)
        self._sample("eval", self.samples is not None and self.samples.cheap(time.monotonic() - self.trained_since))
        self.trained_since = time.monotonic()
        if self.on_evaluate is not None and self.on_evaluate(position.step, eval_loss):
            return StopReason(StopCause.CALLER, position.step,
                              f"stopped at step {position.step} by the caller (eval loss {eval_loss:.4f})")
        return position.early_stop(eval_loss, plan.early_stopping_patience, self.evaluation.metrics.get("general_loss"),
                                   plan.forgetting_limit)

    def _evaluate_base(self) -> None:
        """The untrained model's eval loss and replies: what the run is measured against."""
        if self.evaluation and self.plan.eval_every:  # a stop loses nothing: a resumed run evaluates the base model again
            self.position.base_eval = self.evaluation.untrained() or self.evaluation.loss(
                self.model, 0, self._lower_evaluation_micro_batch, lambda: self._stop_if_signalled(saved=True, last=False))
            self.position.base_general = self.evaluation.metrics.get("general_loss")  # what forgetting is measured from
            self._record_eval(self.position.base_eval)
        if not self.processes.stop_now():
            self._sample("base")
        self.trained_since = time.monotonic()

    def _record_eval(self, eval_loss: float) -> None:
        row = {"step": self.position.step, **self.evaluation.row(eval_loss), **self.usage.row()}
        self.run_dir.append_metrics(row)
        self.reporter.evaluated(row)

    def _sample(self, label: str, due: bool = True) -> None:
        if self.samples is not None:
            self.samples.answer_in_run(self.processes, self.model, self.position.step, label, self.reporter, due)
            self.usage.restart()  # generating is not training: its peak is not the next step's

    def _lower_evaluation_micro_batch(self) -> None:
        plan, recovery = self.recovery.after_oom(self.plan, self.position.step)
        self._apply_plan(plan)
        self.run_dir.add_recovery({**recovery.to_json(), "during": "evaluation"})
        self.reporter.message(f"evaluation after step {self.position.step}: out of memory; {recovery.action}; "
                              "evaluating again", warning=True)

    # ------------------------------------------------------------ checkpoints

    def _save_checkpoint(self) -> None:
        self.reporter.activity(f"saving checkpoint {self.position.step}")
        self.saved_step = self.position.step
        state = {**asdict(self.position), "scheduler": self.scheduler.state_dict(),
                 "micro_batch_size": self.plan.micro_batch_size}
        self.processes.save_checkpoint(self.checkpoints, self.position.step, self.model, self.optimizer, state,
                                       protect=self.position.best_step if self.plan.method == "full" else None)
        self.reporter.activity(None)

    def _stop_if_signalled(self, saved: bool, last: bool) -> None:
        """Stop for SIGINT / SIGTERM (after a step, in one, in an evaluation) with a checkpoint of the last whole step."""
        signum = self.processes.stopping()
        if signum is None or last:
            return
        if not saved and self.saved_step != self.position.step and self.save_artifacts and self.position.step > 0:
            self._save_checkpoint()
        self.run_dir.write_status("interrupted", step=self.position.step, reason=stopped_by(signum))
        raise TrainingInterrupted(signum, self.position.step)

    def _restore(self, checkpoint: Checkpoint, with_optimizer: bool = True) -> None:
        """Put model, optimizer, schedule, RNG and loop position back as they were."""
        state = self.processes.restore_checkpoint(checkpoint, self.model, self.optimizer, with_optimizer)
        self.position = Position.from_state(state)
        self.saved_step = self.position.step  # a stop right after it need not write it again
        self.scheduler.load_state_dict(state["scheduler"])
        self._apply_learning_rate()  # needs the restored step
        self._forget_after(self.position.step)

    def _forget_after(self, step: int) -> None:
        """Going back to `step`: what came after it is trained again."""
        self.run_dir.truncate_logs(step)
        self.best.went_back_to(step)
        self.stability.went_back_to(step)

    # --------------------------------------------------------------- recovery

    def _recover(self, failure: str) -> None:
        plan, recovery = self.recovery.after(failure, self.plan, self.position.step + 1, self.stability.last_spike)
        self._rollback()
        self._apply_plan(plan)
        self.run_dir.add_recovery(recovery.to_json())
        self.reporter.message(f"step {recovery.step}: {recovery.what}; {recovery.action}; continuing from step {self.position.step}", warning=True)

    def _rollback(self) -> None:
        """Back to the last good checkpoint, or to a fresh start if there is none."""
        self.accelerator.wait_for_everyone()
        if (checkpoint := self.checkpoints.latest()) is not None:
            self._restore(checkpoint)
            return
        self.model = self.optimizer = None
        self.accelerator.free_memory()  # drops accelerate's references to the old model
        self._free_memory()
        self.position = Position(base_eval=self.position.base_eval, base_general=self.position.base_general)  # same base model, same losses
        self._setup_training()
        self._forget_after(0)

    def _apply_plan(self, plan: Plan) -> None:
        old, self.plan = self.plan, plan
        if plan.gradient_checkpointing and not old.gradient_checkpointing:
            model = self.accelerator.unwrap_model(self.model)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        if plan.max_seq_len < old.max_seq_len:
            self.data.cut(plan.max_seq_len)
        if plan.lr != old.lr:
            self._apply_learning_rate()
        if plan.micro_batch_size != old.micro_batch_size or plan.max_seq_len != old.max_seq_len:
            self.evaluation.use_micro_batch(self.plan.micro_batch_size)
        self.run_dir.write_plan(plan)

    def _apply_learning_rate(self) -> None:
        set_learning_rate(self.optimizer, self.scheduler, self.plan.lr, self.schedule(self.position.step, self.plan))
    # -------------------------------------------------------------------- end

    def _finish(self, stop: StopReason | None, seconds: float, tokens: int) -> TrainResult:
        """Write the weights the run keeps, answer the samples with them, say so."""
        position, kept = self.position, {}
        if self.save_artifacts:
            self.reporter.activity("saving the trained weights")
            kept = self.best.write(self.model, self.tokenizer, position, self.plan.method)
            self._sample("trained")
        self.reporter.activity(None)
        memory = self.usage.comparison()
        status = self.run_dir.write_status("completed", step=position.step, reason=stop.text if stop else None,
                                           stop_cause=stop.cause.value if stop else None, memory=memory, **position.losses(), **kept)
        if stop is not None:
            self.reporter.message(stop.text)
        rows = self.run_dir.read_metrics()
        return TrainResult.finished(position, stop, RunPace.of(status, rows, seconds, tokens),
                                    self.run_dir.output_path(self.plan.method), kept,
                                    side_by_side(self.run_dir.read_samples()), self.loss.held_out(rows, position.best_step),
                                    memory)
