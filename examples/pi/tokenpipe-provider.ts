/**
 * pi extension: a `tokenpipe` provider that runs `tokenpipe run` as a child process and talks
 * its JSONL protocol directly (no HTTP server).
 *
 *   pi -e ./examples/pi/tokenpipe-provider.ts --provider tokenpipe --model gemma-3-270m
 *
 * Environment:
 *   TOKENPIPE_COMMAND         the executable (default: tokenpipe)
 *   TOKENPIPE_ARGS            extra `tokenpipe run` flags, space separated (e.g. "--max-context 8192")
 *   TOKENPIPE_MODEL_ID        the model id pi shows (default: gemma-3-270m)
 *   TOKENPIPE_CONTEXT_WINDOW  context per session (default: TOKENPIPE_ARGS' --max-context, else 32768)
 *   TOKENPIPE_MAX_TOKENS      reply length pi asks for (default: a quarter of the window, 256-4096)
 *   TOKENPIPE_TOOL_FORMAT     hermes | gemma4 | qwen (default: hermes)
 *
 * Each pi session maps to a named worker session (its KV cache stays warm between turns);
 * text arrives as deltas, tool calls are parsed from the model's markup, usage counts reused
 * prompt tokens as cache reads, and pi's abort signal sends `{"op": "cancel"}`.
 */

import { type ChildProcessWithoutNullStreams, spawn } from "node:child_process";
import { createInterface } from "node:readline";
import {
	type Api,
	type AssistantMessage,
	type AssistantMessageEventStream,
	type Context,
	calculateCost,
	createAssistantMessageEventStream,
	type Model,
	type SimpleStreamOptions,
	type TextContent,
	type ThinkingContent,
	type ToolCall,
} from "@mariozechner/pi-ai";
import type { ExtensionAPI } from "@mariozechner/pi-coding-agent";

type Json = Record<string, unknown>;
type Listener = (event: Json) => void;

// ----------------------------------------------------------------------------- the process

/** One `tokenpipe run` child; requests carry ids so several may be in flight. */
class TokenpipeProcess {
	private child: ChildProcessWithoutNullStreams | null = null;
	private ready: Promise<Json> | null = null;
	private listeners = new Map<string, Listener>();
	private openSessions = new Set<string>();
	private nextId = 1;
	private stderrTail: string[] = [];

	constructor(
		private readonly command: string,
		private readonly args: string[],
	) {}

	start(): Promise<Json> {
		if (this.ready) return this.ready;
		const child = spawn(this.command, ["run", ...this.args], { stdio: ["pipe", "pipe", "pipe"] });
		this.child = child;
		child.stderr.setEncoding("utf8");
		child.stderr.on("data", (chunk: string) => {
			this.stderrTail.push(chunk);
			if (this.stderrTail.length > 50) this.stderrTail.shift();
		});
		this.ready = new Promise<Json>((resolve, reject) => {
			let gotReady = false;
			const lines = createInterface({ input: child.stdout });
			lines.on("line", (line) => {
				if (!line.trim()) return;
				let event: Json;
				try {
					event = JSON.parse(line) as Json;
				} catch {
					return;
				}
				if (!gotReady && event.event === "ready") {
					gotReady = true;
					resolve(event);
					return;
				}
				const listener = this.listeners.get(String(event.id));
				if (listener) listener(event);
			});
			const fail = (why: string) => {
				const message = `tokenpipe run ${why}: ${this.stderrTail.join("").slice(-2000)}`;
				if (!gotReady) reject(new Error(message));
				for (const [id, listener] of this.listeners) {
					listener({ event: "error", id, code: "worker_lost", error: message });
				}
				this.listeners.clear();
				this.openSessions.clear();
				this.child = null;
				this.ready = null;
			};
			child.on("error", (error) => fail(`failed to start (${error.message})`));
			child.on("exit", (code) => fail(`exited with status ${code}`));
		});
		return this.ready;
	}

	private send(request: Json): void {
		this.child?.stdin.write(`${JSON.stringify(request)}\n`);
	}

	/** Send a request; `listener` gets every line answering it. Returns its id. */
	request(request: Json, listener: Listener): string {
		const id = `pi-${this.nextId++}`;
		this.listeners.set(id, listener);
		this.send({ ...request, id });
		return id;
	}

	finish(id: string): void {
		this.listeners.delete(id);
	}

	cancel(id: string): void {
		this.send({ op: "cancel", id });
	}

	/** Open a named session once (an already open one answers an error, which is fine). */
	async ensureSession(sessionId: string): Promise<void> {
		if (this.openSessions.has(sessionId)) return;
		await new Promise<void>((resolve) => {
			const id = this.request({ op: "open", session_id: sessionId }, () => {
				this.finish(id);
				resolve();
			});
		});
		this.openSessions.add(sessionId);
	}

	/** Cancel every request still in flight, then EOF: the child stops its workers and exits. */
	stop(): void {
		for (const id of this.listeners.keys()) this.cancel(id);
		this.listeners.clear();
		this.child?.stdin.end();
	}
}

// ------------------------------------------------------------------------ tool-call markup

interface ParsedCall {
	name: string;
	arguments: Record<string, unknown>;
}
type Piece = { kind: "text"; text: string } | { kind: "call"; call: ParsedCall };

const MARKERS: Record<string, [string, string][]> = {
	hermes: [["<tool_call>", "</tool_call>"]],
	gemma4: [["<|tool_call>", "<tool_call|>"]],
	qwen: [
		["<tool_call>", "</tool_call>"],
		["<function=", "</function>"],
	],
};

function parseGemma4Value(text: string): unknown {
	// Gemma 4 writes `{key:value}` with strings between <|"|>; turn it into JSON.
	const strings: string[] = [];
	const masked = text.replace(/<\|"\|>([\s\S]*?)<\|"\|>/g, (_, s: string) => {
		strings.push(s);
		return `"\u0000${strings.length - 1}"`;
	});
	const quoted = masked.replace(/([{,]\s*)([A-Za-z_][\w.-]*)\s*:/g, '$1"$2":');
	return JSON.parse(quoted, (_key, value) =>
		typeof value === "string" && value.startsWith("\u0000") ? strings[Number(value.slice(1))] : value,
	);
}

function parseCall(format: string, markup: string): ParsedCall | null {
	try {
		if (format === "gemma4") {
			const match = /^<\|tool_call>\s*call:([\w.-]+)\s*(\{[\s\S]*\})\s*<tool_call\|>$/.exec(markup);
			if (!match) return null;
			return { name: match[1], arguments: parseGemma4Value(match[2]) as Record<string, unknown> };
		}
		if (format === "qwen" && markup.includes("<function=")) {
			const fn = /<function=([^>\n]+)>([\s\S]*?)<\/function>/.exec(markup);
			if (!fn) return null;
			const args: Record<string, unknown> = {};
			for (const p of fn[2].matchAll(/<parameter=([^>\n]+)>([\s\S]*?)<\/parameter>/g)) {
				args[p[1].trim()] = p[2].replace(/^\n/, "").replace(/\n$/, "");
			}
			return { name: fn[1].trim(), arguments: args };
		}
		const body = JSON.parse(markup.replace(/^<tool_call>/, "").replace(/<\/tool_call>$/, ""));
		let args = body.arguments ?? body.parameters ?? {};
		if (typeof args === "string") args = JSON.parse(args);
		return typeof body.name === "string" ? { name: body.name, arguments: args } : null;
	} catch {
		return null;
	}
}

/** Incremental splitter: text that could start a marker is held back until decided. */
class MarkupSplitter {
	private buffer = "";
	private end: string | null = null;

	constructor(
		private readonly format: string,
		private readonly tools: Set<string>,
	) {}

	feed(text: string): Piece[] {
		this.buffer += text;
		const out: Piece[] = [];
		for (;;) {
			if (this.end === null) {
				let best: [number, string, string] | null = null;
				for (const [start, end] of MARKERS[this.format] ?? []) {
					const at = this.buffer.indexOf(start);
					if (at >= 0 && (best === null || at < best[0])) best = [at, start, end];
				}
				if (best === null || this.tools.size === 0) {
					const held = this.tools.size === 0 ? 0 : this.heldPrefix();
					const cut = this.buffer.length - held;
					if (cut > 0) out.push({ kind: "text", text: this.buffer.slice(0, cut) });
					this.buffer = this.buffer.slice(cut);
					return out;
				}
				if (best[0] > 0) out.push({ kind: "text", text: this.buffer.slice(0, best[0]) });
				this.buffer = this.buffer.slice(best[0]);
				this.end = best[2];
			}
			const close = this.buffer.indexOf(this.end);
			if (close < 0) return out;
			const markup = this.buffer.slice(0, close + this.end.length);
			this.buffer = this.buffer.slice(close + this.end.length);
			this.end = null;
			const call = parseCall(this.format, markup);
			out.push(call && this.tools.has(call.name) ? { kind: "call", call } : { kind: "text", text: markup });
		}
	}

	finish(): Piece[] {
		const rest = this.buffer;
		this.buffer = "";
		this.end = null;
		return rest ? [{ kind: "text", text: rest }] : [];
	}

	private heldPrefix(): number {
		let best = 0;
		for (const [start] of MARKERS[this.format] ?? []) {
			for (let n = Math.min(start.length - 1, this.buffer.length); n > best; n--) {
				if (this.buffer.endsWith(start.slice(0, n))) {
					best = n;
					break;
				}
			}
		}
		return best;
	}
}

// ------------------------------------------------------------------------------ messages

function textOf(content: string | { type: string; text?: string }[]): string {
	if (typeof content === "string") return content;
	return content
		.filter((part) => part.type === "text")
		.map((part) => part.text ?? "")
		.join("\n");
}

/** pi's context -> tokenpipe `messages` (rendered by the worker with the model's template). */
function toMessages(context: Context): Json[] {
	const messages: Json[] = [];
	if (context.systemPrompt) messages.push({ role: "system", content: context.systemPrompt });
	for (const message of context.messages) {
		if (message.role === "user") {
			messages.push({ role: "user", content: textOf(message.content) });
		} else if (message.role === "assistant") {
			const text = message.content.filter((b): b is TextContent => b.type === "text");
			const thinking = message.content.filter((b): b is ThinkingContent => b.type === "thinking");
			const calls = message.content.filter((b): b is ToolCall => b.type === "toolCall");
			const entry: Json = { role: "assistant", content: text.map((b) => b.text).join("") };
			if (thinking.length) entry.reasoning_content = thinking.map((b) => b.thinking).join("");
			if (calls.length) {
				entry.tool_calls = calls.map((c) => ({
					id: c.id,
					type: "function",
					function: { name: c.name, arguments: c.arguments },
				}));
			}
			messages.push(entry);
		} else {
			messages.push({
				role: "tool",
				tool_call_id: message.toolCallId,
				name: message.toolName,
				content: textOf(message.content),
			});
		}
	}
	return messages;
}

// ------------------------------------------------------------------------------- streaming

function streamTokenpipe(
	proc: TokenpipeProcess,
	toolFormat: string,
	model: Model<Api>,
	context: Context,
	options?: SimpleStreamOptions,
): AssistantMessageEventStream {
	const stream = createAssistantMessageEventStream();
	const output: AssistantMessage = {
		role: "assistant",
		content: [],
		api: model.api,
		provider: model.provider,
		model: model.id,
		usage: {
			input: 0,
			output: 0,
			cacheRead: 0,
			cacheWrite: 0,
			totalTokens: 0,
			cost: { input: 0, output: 0, cacheRead: 0, cacheWrite: 0, total: 0 },
		},
		stopReason: "stop",
		timestamp: Date.now(),
	};
	const tools = new Set((context.tools ?? []).map((t) => t.name));
	const splitter = new MarkupSplitter(toolFormat, tools);
	let textIndex = -1;
	let callCount = 0;

	const emit = (pieces: Piece[]) => {
		for (const piece of pieces) {
			if (piece.kind === "text") {
				if (!piece.text) continue;
				if (textIndex < 0) {
					output.content.push({ type: "text", text: "" });
					textIndex = output.content.length - 1;
					stream.push({ type: "text_start", contentIndex: textIndex, partial: output });
				}
				(output.content[textIndex] as TextContent).text += piece.text;
				stream.push({ type: "text_delta", contentIndex: textIndex, delta: piece.text, partial: output });
			} else {
				closeText();
				const call: ToolCall = {
					type: "toolCall",
					id: `call_${Date.now().toString(36)}_${callCount++}`,
					name: piece.call.name,
					arguments: piece.call.arguments as Record<string, any>,
				};
				output.content.push(call);
				const index = output.content.length - 1;
				stream.push({ type: "toolcall_start", contentIndex: index, partial: output });
				const json = JSON.stringify(call.arguments);
				stream.push({ type: "toolcall_delta", contentIndex: index, delta: json, partial: output });
				stream.push({ type: "toolcall_end", contentIndex: index, toolCall: call, partial: output });
			}
		}
	};
	const closeText = () => {
		if (textIndex >= 0) {
			const content = (output.content[textIndex] as TextContent).text;
			stream.push({ type: "text_end", contentIndex: textIndex, content, partial: output });
			textIndex = -1;
		}
	};
	const fail = (reason: "aborted" | "error", message: string) => {
		output.stopReason = reason;
		output.errorMessage = message;
		stream.push({ type: "error", reason, error: output });
		stream.end();
	};

	(async () => {
		try {
			await proc.start();
			stream.push({ type: "start", partial: output });
			if (options?.signal?.aborted) return fail("aborted", "aborted before the request was sent");
			const sessionId = options?.sessionId;
			if (sessionId) await proc.ensureSession(sessionId);
			const request: Json = {
				messages: toMessages(context),
				max_new_tokens: options?.maxTokens ?? model.maxTokens,
				temperature: options?.temperature ?? 0.7,
			};
			if (tools.size) {
				request.tools = (context.tools ?? []).map((t) => ({
					type: "function",
					function: { name: t.name, description: t.description, parameters: t.parameters },
				}));
			}
			if (sessionId) request.session_id = sessionId;
			const id = proc.request(request, (event) => {
				if (event.event === "token") {
					emit(splitter.feed(String(event.token ?? "")));
				} else if (event.event === "done") {
					proc.finish(id);
					options?.signal?.removeEventListener("abort", onAbort);
					emit(splitter.finish());
					closeText();
					const reused = Number(event.reused_prompt_tokens ?? 0);
					output.usage.input = Number(event.prompt_tokens ?? 0) - reused;
					output.usage.cacheRead = reused;
					output.usage.output = Number(event.completion_tokens ?? 0);
					output.usage.totalTokens = output.usage.input + output.usage.cacheRead + output.usage.output;
					calculateCost(model, output.usage);
					if (event.finish_reason === "cancelled") return fail("aborted", "cancelled");
					output.stopReason = callCount > 0 ? "toolUse" : event.finish_reason === "length" ? "length" : "stop";
					stream.push({ type: "done", reason: output.stopReason, message: output });
					stream.end();
				} else if (event.event === "error") {
					proc.finish(id);
					options?.signal?.removeEventListener("abort", onAbort);
					fail("error", `${event.code}: ${event.error}`);
				}
			});
			const onAbort = () => proc.cancel(id);
			options?.signal?.addEventListener("abort", onAbort, { once: true });
		} catch (error) {
			fail(options?.signal?.aborted ? "aborted" : "error", error instanceof Error ? error.message : String(error));
		}
	})();
	return stream;
}

// ------------------------------------------------------------------------------ extension

export default function tokenpipeExtension(pi: ExtensionAPI): void {
	const command = process.env.TOKENPIPE_COMMAND ?? "tokenpipe";
	const args = (process.env.TOKENPIPE_ARGS ?? "").split(/\s+/).filter(Boolean);
	// The context `tokenpipe run` serves: TOKENPIPE_CONTEXT_WINDOW, else the --max-context in
	// TOKENPIPE_ARGS, else the worker's default for the default model (32768 on the CPU).
	const argContext = args.indexOf("--max-context") >= 0 ? args[args.indexOf("--max-context") + 1] : undefined;
	const contextWindow = Number(process.env.TOKENPIPE_CONTEXT_WINDOW ?? argContext ?? 32768);
	// pi asks for maxTokens new tokens every turn: a reply length, not the whole window.
	const maxTokens = Number(process.env.TOKENPIPE_MAX_TOKENS ?? Math.max(256, Math.min(4096, Math.floor(contextWindow / 4))));
	const toolFormat = process.env.TOKENPIPE_TOOL_FORMAT ?? "hermes";
	const proc = new TokenpipeProcess(command, args);

	pi.registerProvider("tokenpipe", {
		name: "tokenpipe (local JSONL)",
		baseUrl: "tokenpipe://run",
		apiKey: "tokenpipe",
		api: "tokenpipe-jsonl",
		models: [
			{
				id: process.env.TOKENPIPE_MODEL_ID ?? "gemma-3-270m",
				name: "tokenpipe local model",
				reasoning: false,
				input: ["text"],
				cost: { input: 0, output: 0, cacheRead: 0, cacheWrite: 0 },
				contextWindow,
				maxTokens,
			},
		],
		streamSimple: (model, context, options) => streamTokenpipe(proc, toolFormat, model, context, options),
	});
	pi.on("session_shutdown", () => proc.stop());
}

// Exported for tests and for reuse by other extensions.
export { MarkupSplitter, TokenpipeProcess, toMessages, streamTokenpipe };
