//! A streaming OpenAI chat client that times every token: TTFT (first content delta), inter-token
//! latencies, end-to-end; and reads usage (prompt, cached, completion tokens) from the final
//! `stream_options.include_usage` chunk.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};

/// Everything recorded about one request.
#[derive(Clone, Debug, Serialize)]
pub struct RequestRecord {
    pub label: String,
    pub workload: String,
    pub session: String,
    pub class: String,
    pub turn: usize,
    pub request_id: String,
    pub context_limit: Option<u64>,
    pub actual_prompt_tokens: Option<u64>,
    pub requested_output_tokens: u32,
    pub actual_output_tokens: Option<u64>,
    pub finish_reason: Option<String>,
    pub cached_tokens: Option<u64>,
    pub ttft_seconds: Option<f64>,
    pub inter_token_latencies: Vec<f64>,
    pub e2e_seconds: f64,
    /// Seconds from the wave start to this request's start.
    pub started_at: f64,
    pub status: u16,
    pub worker: Option<String>,
    pub error: Option<String>,
    #[serde(skip)]
    pub answer: String,
}

impl RequestRecord {
    pub fn ok(&self) -> bool {
        self.status == 200 && self.error.is_none()
    }
}

/// What to send.
pub struct ChatCall<'a> {
    pub base_url: &'a str,
    pub model: &'a str,
    pub messages: &'a [Value],
    pub max_tokens: u32,
    pub request_id: String,
    pub timeout: Duration,
}

/// Header names a serving worker may be reported under (gateway first, then worker).
const WORKER_HEADERS: &[&str] = &["x-kvgate-worker", "x-kvgate-worker-id"];

/// Send one streaming chat completion and time it. Never panics on a bad answer: errors are
/// recorded in the returned record.
pub async fn chat(client: &reqwest::Client, call: ChatCall<'_>, rec: &mut RequestRecord) {
    let body = json!({
        "model": call.model,
        "messages": call.messages,
        "max_tokens": call.max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let url = format!(
        "{}/v1/chat/completions",
        call.base_url.trim_end_matches('/')
    );
    let t0 = Instant::now();
    rec.request_id = call.request_id.clone();
    rec.requested_output_tokens = call.max_tokens;
    let resp = client
        .post(&url)
        .header("x-request-id", &call.request_id)
        .timeout(call.timeout)
        .json(&body)
        .send()
        .await;
    let resp = match resp {
        Ok(r) => r,
        Err(e) => {
            rec.status = 0;
            rec.error = Some(format!("send: {e}"));
            rec.e2e_seconds = t0.elapsed().as_secs_f64();
            return;
        }
    };
    rec.status = resp.status().as_u16();
    rec.worker = WORKER_HEADERS
        .iter()
        .find_map(|h| resp.headers().get(*h))
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    if !resp.status().is_success() {
        let text = resp.text().await.unwrap_or_default();
        let code = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["error"]["code"].as_str().map(str::to_string));
        rec.error = Some(code.unwrap_or_else(|| text.chars().take(200).collect()));
        rec.e2e_seconds = t0.elapsed().as_secs_f64();
        return;
    }
    let mut stream = resp.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut last_token_at: Option<Instant> = None;
    let mut done = false;
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                rec.error = Some(format!("stream: {e}"));
                break;
            }
        };
        buf.extend_from_slice(&chunk);
        // SSE events end with a blank line; chunks don't align with events.
        while let Some(pos) = find_event_end(&buf) {
            let event: Vec<u8> = buf.drain(..pos).collect();
            for line in String::from_utf8_lossy(&event).lines() {
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim();
                if data == "[DONE]" {
                    done = true;
                    continue;
                }
                let Ok(v) = serde_json::from_str::<Value>(data) else {
                    rec.error = Some("unparsable SSE event".into());
                    continue;
                };
                if v.get("error").is_some() {
                    rec.error = Some(
                        v["error"]["code"]
                            .as_str()
                            .unwrap_or("stream_error")
                            .to_string(),
                    );
                }
                if let Some(choice) = v["choices"].get(0) {
                    if let Some(text) = choice["delta"]["content"].as_str() {
                        if !text.is_empty() {
                            let now = Instant::now();
                            match last_token_at {
                                None => rec.ttft_seconds = Some((now - t0).as_secs_f64()),
                                Some(prev) => {
                                    rec.inter_token_latencies.push((now - prev).as_secs_f64())
                                }
                            }
                            last_token_at = Some(now);
                            rec.answer.push_str(text);
                        }
                    }
                    if let Some(fr) = choice["finish_reason"].as_str() {
                        rec.finish_reason = Some(fr.to_string());
                    }
                }
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    rec.actual_prompt_tokens = u["prompt_tokens"].as_u64();
                    rec.actual_output_tokens = u["completion_tokens"].as_u64();
                    rec.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].as_u64();
                }
            }
        }
    }
    if !done && rec.error.is_none() {
        rec.error = Some("stream ended without [DONE]".into());
    }
    rec.e2e_seconds = t0.elapsed().as_secs_f64();
}

fn find_event_end(buf: &[u8]) -> Option<usize> {
    buf.windows(2).position(|w| w == b"\n\n").map(|p| p + 2)
}

/// The target's context limit, from a kvgate worker's `/v1/profile` when it has one.
pub async fn context_limit(client: &reqwest::Client, base_url: &str) -> Option<u64> {
    let url = format!("{}/v1/profile", base_url.trim_end_matches('/'));
    let v: Value = client.get(url).send().await.ok()?.json().await.ok()?;
    v["context_limit"].as_u64()
}

#[cfg(test)]
mod tests {
    use super::find_event_end;

    #[test]
    fn event_boundaries() {
        assert_eq!(find_event_end(b"data: x\n\ndata: y"), Some(9));
        assert_eq!(find_event_end(b"data: x\n"), None);
    }
}
