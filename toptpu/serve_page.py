"""The chat page `toptpu serve` answers at `/`: a chat box over the server's own API
(`POST /v1/chat/completions` with `stream: true`), the reply shown as its events arrive.
No external script, style or font: the page works offline and sends nothing elsewhere."""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>toptpu serve</title>
<style>
body { font: 15px/1.4 system-ui, sans-serif; max-width: 46rem; margin: 1rem auto;
       padding: 0 1rem; }
#log { border: 1px solid #ccc; border-radius: 6px; padding: .5rem; min-height: 16rem;
       white-space: pre-wrap; overflow-y: auto; max-height: 70vh; }
.user { color: #1a4f8b; } .assistant { color: #222; } .error { color: #a00; }
.stats { color: #777; font-size: 12px; }
form { display: flex; gap: .5rem; margin-top: .5rem; }
#msg { flex: 1; padding: .4rem; } #key { width: 10rem; }
</style>
</head>
<body>
<h1>toptpu serve</h1>
<p id="model">model: ...</p>
<div id="log"></div>
<form id="form">
<input id="msg" autocomplete="off" placeholder="Message" required>
<input id="key" type="password" placeholder="API key (if set)">
<button id="send">Send</button>
<button id="reset" type="button">New chat</button>
</form>
<script>
const log = document.getElementById("log");
let model = null, messages = [];
function line(cls, text) {
  const p = document.createElement("div"); p.className = cls; p.textContent = text;
  log.appendChild(p); log.scrollTop = log.scrollHeight; return p;
}
function headers() {
  const h = {"Content-Type": "application/json"};
  const key = document.getElementById("key").value;
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}
async function loadModel() {
  const r = await fetch("/v1/models", {headers: headers()});
  const j = await r.json();
  if (!r.ok) { line("error", j.error ? j.error.message : r.statusText); return; }
  model = j.data[0].id;
  document.getElementById("model").textContent = "model: " + model;
}
document.getElementById("reset").onclick = () => { messages = []; log.textContent = ""; };
document.getElementById("form").onsubmit = async (ev) => {
  ev.preventDefault();
  if (!model) await loadModel();
  if (!model) return;
  const box = document.getElementById("msg"), text = box.value; box.value = "";
  messages.push({role: "user", content: text});
  line("user", "> " + text);
  const out = line("assistant", "");
  const r = await fetch("/v1/chat/completions", {method: "POST", headers: headers(),
    body: JSON.stringify({model, messages, stream: true,
                          stream_options: {include_usage: true}})});
  if (!r.ok) { const j = await r.json(); line("error", j.error.message); messages.pop();
               return; }
  const reader = r.body.getReader(), dec = new TextDecoder();
  let buf = "", reply = "";
  for (;;) {
    const {value, done} = await reader.read(); if (done) break;
    buf += dec.decode(value, {stream: true});
    let at;
    while ((at = buf.indexOf("\\n\\n")) >= 0) {
      const ev = buf.slice(0, at); buf = buf.slice(at + 2);
      if (!ev.startsWith("data: ")) continue;
      const data = ev.slice(6); if (data === "[DONE]") continue;
      const j = JSON.parse(data);
      if (j.error) { line("error", j.error.message); continue; }
      if (j.choices && j.choices.length && j.choices[0].delta.content) {
        reply += j.choices[0].delta.content; out.textContent = reply;
      }
      if (j.usage) {
        const t = j.toptpu || {};
        line("stats", `[${j.usage.prompt_tokens} prompt tokens, ` +
             `${j.usage.prompt_tokens_details.cached_tokens} kept; ` +
             `${j.usage.completion_tokens} generated; first token ` +
             `${(1e3 * t.ttft_s).toFixed(1)} ms host` +
             (t.modelled_ttft_s != null ? `, ${(1e3 * t.modelled_ttft_s).toFixed(3)} ms ` +
              "modelled" : "") + "]");
      }
    }
  }
  messages.push({role: "assistant", content: reply});
};
loadModel();
</script>
</body>
</html>
"""
