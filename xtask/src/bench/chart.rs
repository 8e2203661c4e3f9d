//! The bench's chart: throughput as a ratio to the loop, an SVG drawn by hand (no plotting
//! dependency for one bar chart).

use super::options::Contender;
use serde_json::Value;

/// Throughput per backend, workload, process count and contender, as ratios to contender 1 at
/// the same total concurrency, as an SVG bar chart.
pub fn chart(results: &Value) -> String {
    // One group of bars per backend, workload and process count.
    let backends: Vec<Value> = results["backends"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|b| {
            b["groups"].as_array().into_iter().flatten().map(|g| {
                serde_json::json!({
                    "backend": format!(
                        "{} {} x{}",
                        b["backend"].as_str().unwrap_or(""),
                        g["workload"].as_str().unwrap_or(""),
                        g["processes"]
                    ),
                    "contenders": g["contenders"].clone(),
                })
            })
        })
        .collect();
    let colors = ["#9e9e9e", "#f4a261", "#2a9d8f", "#264653"];
    let (bar, gap, top, left, height) = (22.0, 36.0, 40.0, 60.0, 240.0);
    let per_group = 4.0 * bar;
    let width = left + backends.len() as f64 * (per_group + gap) + 200.0;
    let max = backends
        .iter()
        .flat_map(|b| b["contenders"].as_array().into_iter().flatten())
        .filter_map(|c| c["ratio_to_loop"].as_f64())
        .fold(1.0_f64, f64::max)
        .ceil();
    let y = |ratio: f64| top + height - ratio / max * height;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width:.0}\" height=\"{:.0}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <text x=\"{left}\" y=\"20\" font-size=\"14\">msgs/s as a ratio to a plain sqlx loop doing the same transaction at the same total concurrency (1.0), {} messages; hot: 40 accounts, spread: 1,000; x1, x3: consumer processes</text>\n",
        top + height + 50.0,
        results["messages"]
    );
    for step in 0..=(max as usize) {
        let yy = y(step as f64);
        svg += &format!(
            "<line x1=\"{left}\" x2=\"{:.0}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\" stroke=\"#ddd\"/><text x=\"{:.0}\" y=\"{:.1}\" text-anchor=\"end\">{step}.0x</text>\n",
            width - 200.0,
            left - 6.0,
            yy + 4.0
        );
    }
    for (g, b) in backends.iter().enumerate() {
        let x0 = left + gap / 2.0 + g as f64 * (per_group + gap);
        for (i, c) in b["contenders"].as_array().into_iter().flatten().enumerate() {
            let Some(ratio) = c["ratio_to_loop"].as_f64() else {
                continue;
            };
            let color = colors[Contender::ALL
                .iter()
                .position(|k| Some(k.name()) == c["contender"].as_str())
                .unwrap_or(0)];
            let x = x0 + i as f64 * bar;
            svg += &format!(
                "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{color}\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"10\">{ratio:.2}</text>\n",
                y(ratio),
                bar - 4.0,
                top + height - y(ratio),
                x + (bar - 4.0) / 2.0,
                y(ratio) - 3.0
            );
        }
        svg += &format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"10\">{}</text>\n",
            x0 + per_group / 2.0,
            top + height + 18.0,
            b["backend"].as_str().unwrap_or("")
        );
    }
    for (i, c) in Contender::ALL.iter().enumerate() {
        let (x, yy) = (width - 190.0, top + 10.0 + i as f64 * 20.0);
        svg += &format!(
            "<rect x=\"{x:.0}\" y=\"{:.0}\" width=\"12\" height=\"12\" fill=\"{}\"/><text x=\"{:.0}\" y=\"{:.0}\">{}</text>\n",
            yy - 10.0,
            colors[i],
            x + 18.0,
            yy,
            c.name()
        );
    }
    svg + "</svg>\n"
}
