// The chat page: talks to this server's /v1/models and /v1/chat/completions (streaming SSE).
// Model output is only ever put into the page as text (markdown.js builds DOM nodes); the API key
// lives in the key field of this page only (no cookie, no storage). Images attached to a message
// (file picker or paste) are read in the page (FileReader) and sent inline as `data:` URLs.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const ui = {
    messages: $("messages"), emptyHint: $("empty-hint"), form: $("composer"), input: $("input"),
    send: $("send"), stop: $("stop"), clear: $("clear"), keyBox: $("api-key-box"), key: $("api-key"),
    system: $("system-prompt"), temperature: $("temperature"), topP: $("top-p"), maxTokens: $("max-tokens"),
    seed: $("seed"), modelName: $("model-name"), modelSelect: $("model-select"), modelCtx: $("model-ctx"),
    status: $("server-status"), statusText: $("status-text"), attach: $("attach"), attachInput: $("attach-input"),
    attachments: $("attachments"), attachNote: $("attach-note"),
  };
  // attachments: the images of the message being written, {name, url}; reading: their FileReaders
  // still running (a send waits for them).
  const state = { model: null, models: [], history: [], controller: null, attachments: [], reading: new Set(),
                  sending: false, takesImages: null };
  // One image's limit, the server's default (--max_image_bytes: 20 MiB after decoding).
  const MAX_IMAGE_BYTES = 20 * 1024 * 1024;

  function setStatus(kind, text) {
    ui.status.dataset.state = kind;
    ui.statusText.textContent = text;
  }

  function requestHeaders(json) {
    const headers = {};
    if (json) headers["Content-Type"] = "application/json";
    const key = ui.key.value.trim();
    if (key) headers["Authorization"] = "Bearer " + key;
    return headers;
  }

  function askForKey(message) {
    ui.keyBox.hidden = false;
    setStatus("locked", message);
  }

  // The OpenAI-style error of a refused request, as one line of text.
  async function describeError(response) {
    let message = "";
    try {
      const body = await response.json();
      message = (body && body.error && body.error.message) || "";
    } catch (e) {
      message = "";
    }
    let text = "HTTP " + response.status + (response.statusText ? " " + response.statusText : "");
    if (message) text += ": " + message;
    const retryAfter = response.headers.get("Retry-After");
    if (response.status === 429 && retryAfter) text += " (retry after " + retryAfter + " s)";
    if (response.status === 413) text += " (attached images travel inside the request, base64: a third larger)";
    if (response.status === 401) {
      askForKey(ui.key.value.trim() ? "API key rejected" : "API key required");
      text += " — enter the server's API key under Settings.";
    }
    return text;
  }

  async function loadModels() {
    let response;
    try {
      response = await fetch("/v1/models", { headers: requestHeaders(false), cache: "no-store" });
    } catch (e) {
      setStatus("down", "server unreachable");
      return;
    }
    if (response.status === 401) {
      askForKey(ui.key.value.trim() ? "API key rejected" : "API key required");
      return;
    }
    if (!response.ok) {
      setStatus("down", "/v1/models: HTTP " + response.status);
      return;
    }
    const body = await response.json();
    state.models = body.data || [];
    if (!state.models.length) {
      setStatus("down", "no model served");
      return;
    }
    // The base model, or a LoRA adapter (listed with its `parent`): picked in the select when the
    // server serves more than one; the choice is kept across reloads while it is still served.
    const model = state.models.find((m) => m.id === state.model) || state.models[0];
    ui.modelSelect.replaceChildren(...state.models.map((m) => {
      const option = document.createElement("option");
      option.value = m.id;
      option.textContent = m.parent ? m.id + " (LoRA)" : m.id;
      return option;
    }));
    ui.modelSelect.hidden = state.models.length < 2;
    ui.modelName.hidden = !ui.modelSelect.hidden;
    useModel(model);
    setStatus("ok", "ready");
  }

  function useModel(model) {
    state.model = model.id;
    ui.modelSelect.value = model.id;
    ui.modelName.textContent = model.id;
    ui.modelCtx.textContent = model.max_model_len ? model.max_model_len + " tokens" : "?";
    showSamplingDefaults(model.sampling_defaults || {});
    state.takesImages = takesImages(model);
    ui.attach.disabled = state.takesImages === false;
    ui.attach.title = state.takesImages === false ? "this model takes no images"
      : "Attach images (or paste one into the message)";
  }

  // Whether the model takes images, where its model card says so (`input_modalities`, at the top or
  // under `architecture`); null when it does not say: attaching is allowed and the server decides.
  function takesImages(model) {
    const modalities = model.input_modalities || (model.architecture && model.architecture.input_modalities);
    return Array.isArray(modalities) ? modalities.includes("image") : null;
  }

  // ---- images attached to the message being written ----

  function note(text) {
    ui.attachNote.textContent = text || "";
  }

  function megabytes(bytes) {
    return (bytes / (1024 * 1024)).toFixed(1) + " MB";
  }

  // Reads image files into data: URLs and adds them to the message; refusals are noted beside the button.
  function attachFiles(files) {
    const refused = [];
    for (const file of files) {
      const name = file.name || "pasted image";
      if (state.takesImages === false) {
        refused.push("this model takes no images");
        break;
      }
      if (!file.type.startsWith("image/")) {
        refused.push(name + " is not an image");
        continue;
      }
      if (file.size > MAX_IMAGE_BYTES) {
        refused.push(name + " is " + megabytes(file.size) + ", over the " + megabytes(MAX_IMAGE_BYTES) +
                     " limit for one image");
        continue;
      }
      const reading = new Promise((resolve) => {
        const reader = new FileReader();
        reader.onload = () => {
          state.attachments.push({ name, url: reader.result });
          showAttachments();
          resolve();
        };
        reader.onerror = () => {
          note("could not read " + name);
          resolve();
        };
        reader.readAsDataURL(file);
      });
      state.reading.add(reading);
      reading.then(() => state.reading.delete(reading));
    }
    note(refused.join("; "));
  }

  // The thumbnails of the attached images, each with its remove button.
  function showAttachments() {
    ui.attachments.replaceChildren(...state.attachments.map((image, index) => {
      const thumb = document.createElement("figure");
      thumb.className = "thumb";
      const img = document.createElement("img");
      img.src = image.url;
      img.alt = image.name;
      img.title = image.name;
      const remove = document.createElement("button");
      remove.type = "button";
      remove.className = "remove";
      remove.textContent = "×";
      remove.title = "remove " + image.name;
      remove.setAttribute("aria-label", "remove " + image.name);
      remove.addEventListener("click", () => {
        state.attachments.splice(index, 1);
        showAttachments();
        ui.input.focus();
      });
      thumb.append(img, remove);
      return thumb;
    }));
    ui.attachments.hidden = !state.attachments.length;
  }

  // A user turn's content: plain text, or with images the OpenAI parts (the images, then the text).
  function userContent(text, images) {
    if (!images.length) return text;
    const parts = images.map((image) => ({ type: "image_url", image_url: { url: image.url } }));
    if (text.trim()) parts.push({ type: "text", text });
    return parts;
  }

  // An empty sampling field shows the value the server will use for it (its defaults, else OpenAI's).
  function showSamplingDefaults(defaults) {
    const fields = [[ui.temperature, "temperature", 1], [ui.topP, "top_p", 1]];
    for (const [input, name, fallback] of fields) {
      input.placeholder = String(name in defaults ? defaults[name] : fallback);
    }
  }

  // The payloads of the SSE `data:` lines of a response body. Lines end at "\n" bytes only.
  async function* sseData(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder("utf-8");
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        buffer += done ? decoder.decode() : decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.indexOf("\n")) >= 0) {
          let line = buffer.slice(0, end);
          buffer = buffer.slice(end + 1);
          if (line.endsWith("\r")) line = line.slice(0, -1);
          if (line.startsWith("data:")) yield line.slice(line.startsWith("data: ") ? 6 : 5);
        }
        if (done) return;
      }
    } finally {
      reader.releaseLock();
    }
  }

  function scrollToEnd(force) {
    const m = ui.messages;
    if (force || m.scrollHeight - m.scrollTop - m.clientHeight < 120) m.scrollTop = m.scrollHeight;
  }

  function addMessage(role) {
    ui.emptyHint.hidden = true;
    const node = document.createElement("div");
    node.className = "message " + role;
    const who = document.createElement("div");
    who.className = "role";
    who.textContent = role === "user" ? "You" : state.model || "assistant";
    const body = document.createElement("div");
    body.className = "body";
    node.append(who, body);
    ui.messages.append(node);
    return { node, body };
  }

  function addUserMessage(text, images) {
    const view = addMessage("user");
    if (images.length) {
      const strip = document.createElement("div");
      strip.className = "images";
      for (const image of images) {
        const img = document.createElement("img");
        img.src = image.url;
        img.alt = image.name;
        img.title = image.name;
        strip.append(img);
      }
      view.body.append(strip);
    }
    if (text.trim()) {
      const span = document.createElement("span");
      span.className = "text";
      span.textContent = text;
      view.body.append(span);
    }
    scrollToEnd(true);
    return view;
  }

  // The assistant's bubble: markdown re-rendered at most once per frame while tokens stream.
  function addAssistantMessage() {
    const view = addMessage("assistant");
    view.body.classList.add("markdown", "streaming");
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.textContent = "waiting for the first token…";
    view.node.append(stats);
    let pending = null;
    let scheduled = false;
    const flush = () => {
      scheduled = false;
      if (pending === null) return;
      view.body.replaceChildren(window.jaxserveMarkdown.render(pending));
      pending = null;
      scrollToEnd(false);
    };
    return {
      node: view.node,
      update(text) {
        pending = text;
        if (!scheduled) {
          scheduled = true;
          requestAnimationFrame(flush);
        }
      },
      finish(text) {
        pending = text;
        flush();
        view.body.classList.remove("streaming");
        view.body.hidden = !text;
      },
      setStats(parts) {
        stats.replaceChildren();
        for (const [name, value] of parts) {
          const span = document.createElement("span");
          span.dataset.stat = name;
          span.textContent = value;
          stats.append(span);
        }
      },
      showError(text) {
        const error = document.createElement("div");
        error.className = "error";
        error.setAttribute("role", "alert");
        error.textContent = text;
        view.node.insertBefore(error, stats);
        scrollToEnd(true);
      },
    };
  }

  function numberField(input, parse) {
    const raw = input.value.trim();
    if (raw === "") return undefined;
    const value = parse(raw);
    return Number.isFinite(value) ? value : undefined;
  }

  function setBusy(busy) {
    ui.send.hidden = busy;
    ui.stop.hidden = !busy;
    ui.input.classList.toggle("busy", busy);
  }

  function statsParts(r) {
    const parts = [];
    if (r.ttftMs !== null) parts.push(["ttft", "TTFT " + Math.round(r.ttftMs) + " ms"]);
    const n = r.usage ? r.usage.completion_tokens : r.chunks;
    if (n > 1 && r.tLast > r.tFirst) {
      parts.push(["speed", ((n - 1) / ((r.tLast - r.tFirst) / 1000)).toFixed(1) + " tokens/s"]);
    }
    if (r.usage) {
      parts.push(["tokens", r.usage.prompt_tokens + " prompt + " + r.usage.completion_tokens + " completion tokens"]);
    } else {
      parts.push(["tokens", "~" + r.chunks + " tokens"]);
    }
    parts.push(["finish", r.finish === "stopped" ? "stopped" : "finish: " + r.finish]);
    return parts;
  }

  async function send(text, images) {
    const messages = [];
    const system = ui.system.value.trim();
    if (system) messages.push({ role: "system", content: system });
    const userTurn = { role: "user", content: userContent(text, images) };
    messages.push(...state.history, userTurn);
    addUserMessage(text, images);
    const view = addAssistantMessage();

    const body = { messages, stream: true, stream_options: { include_usage: true } };
    if (state.model) body.model = state.model;
    const fields = [["temperature", ui.temperature, parseFloat], ["top_p", ui.topP, parseFloat],
                    ["max_tokens", ui.maxTokens, (s) => parseInt(s, 10)], ["seed", ui.seed, (s) => parseInt(s, 10)]];
    for (const [name, input, parse] of fields) {
      const value = numberField(input, parse);
      if (value !== undefined) body[name] = value;
    }

    const controller = new AbortController();
    state.controller = controller;
    setBusy(true);
    const run = { t0: performance.now(), tFirst: null, tLast: null, ttftMs: null, chunks: 0, usage: null,
                  finish: null };
    let answer = "";
    let error = null;
    let sawDone = false;
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST", headers: requestHeaders(true), body: JSON.stringify(body), signal: controller.signal,
      });
      if (!response.ok) {
        error = await describeError(response);
        if (response.status !== 401) setStatus("ok", "ready");
      } else {
        setStatus("ok", "generating…");
        for await (const data of sseData(response.body)) {
          if (data === "[DONE]") {
            sawDone = true;
            break;
          }
          let chunk;
          try {
            chunk = JSON.parse(data);
          } catch (e) {
            continue;
          }
          if (chunk.error) {
            error = "the server ended the answer: " + chunk.error.message;
            continue;
          }
          if (chunk.usage) run.usage = chunk.usage;
          for (const choice of chunk.choices || []) {
            const piece = choice.delta && choice.delta.content;
            if (piece) {
              const now = performance.now();
              if (run.tFirst === null) {
                run.tFirst = now;
                run.ttftMs = now - run.t0;
              }
              run.tLast = now;
              run.chunks += 1;
              answer += piece;
              view.update(answer);
              view.setStats([["ttft", "TTFT " + Math.round(run.ttftMs) + " ms"],
                             ["tokens", run.chunks + " tokens…"]]);
            }
            if (choice.finish_reason) run.finish = choice.finish_reason;
          }
        }
        if (!sawDone && !error) error = "the connection closed before the answer finished (did the server stop?)";
        setStatus(error ? "down" : "ok", error ? "connection lost" : "ready");
      }
    } catch (e) {
      if (e && e.name === "AbortError") {
        run.finish = "stopped";
        setStatus("ok", "ready");
      } else {
        error = "cannot reach the server (" + (e && e.message ? e.message : e) + "); is it still running?";
        setStatus("down", "server unreachable");
      }
    } finally {
      if (state.controller === controller) state.controller = null;
      setBusy(false);
    }

    view.finish(answer);
    if (error) view.showError(error);
    if (answer || run.finish === "stopped") {
      run.finish = run.finish || (error ? "error" : "done");
      view.setStats(statsParts(run));
      view.node.dataset.finish = run.finish;
    } else {
      view.setStats([]);
      view.node.dataset.finish = error ? "error" : run.finish || "done";
    }
    if (answer) {
      state.history.push(userTurn, { role: "assistant", content: answer });
    } else if (!ui.input.value && !state.attachments.length) {
      ui.input.value = text;  // nothing came back: the message can be sent again
      state.attachments = images;
      showAttachments();
    }
  }

  ui.form.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (state.controller || state.sending) return;
    state.sending = true;
    try {
      await Promise.all([...state.reading]);  // images still being read go with the message
    } finally {
      state.sending = false;
    }
    const text = ui.input.value;
    const images = state.attachments;
    if ((!text.trim() && !images.length) || state.controller) return;
    ui.input.value = "";
    state.attachments = [];
    showAttachments();
    note("");
    send(text, images);
  });
  ui.attach.addEventListener("click", () => ui.attachInput.click());
  ui.attachInput.addEventListener("change", () => {
    attachFiles([...ui.attachInput.files]);
    ui.attachInput.value = "";  // the same file can be picked again
  });
  ui.input.addEventListener("paste", (event) => {
    const items = event.clipboardData ? [...event.clipboardData.items] : [];
    const files = items.filter((item) => item.kind === "file" && item.type.startsWith("image/"))
      .map((item) => item.getAsFile()).filter(Boolean);
    if (files.length) attachFiles(files);  // any text in the clipboard is pasted as usual
  });
  ui.input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      ui.form.requestSubmit();
    }
  });
  ui.stop.addEventListener("click", () => {
    if (state.controller) state.controller.abort();
  });
  ui.clear.addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.history = [];
    for (const node of [...ui.messages.querySelectorAll(".message")]) node.remove();
    ui.emptyHint.hidden = false;
    ui.input.focus();
  });
  ui.key.addEventListener("change", loadModels);
  ui.modelSelect.addEventListener("change", () => {
    const model = state.models.find((m) => m.id === ui.modelSelect.value);
    if (model) useModel(model);
  });

  loadModels();
  ui.input.focus();
})();
