//! The `pagedkv run --no-cache --plot` figure: time per step against the scheduled
//! sequences' mean length, with the KV cache and without it.

use plotters::prelude::*;

use super::RunReport;

/// An SVG of both runs' step times (milliseconds) against mean sequence length.
pub fn render_step_times(cached: &RunReport, recomputed: &RunReport) -> Result<String, String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 520)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let all = cached.step_times.iter().chain(&recomputed.step_times);
        let max_len = all.clone().map(|p| p.0).fold(1.0, f64::max);
        let max_ms = all.map(|p| 1e3 * p.1).fold(1e-3, f64::max);
        let mut chart = ChartBuilder::on(&root)
            .caption(
                "pagedkv run: time per step against sequence length",
                ("sans-serif", 20),
            )
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(0.0..max_len * 1.05, 0.0..max_ms * 1.1)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("mean context length of the step's sequences (tokens)")
            .y_desc("step time (ms)")
            .draw()
            .map_err(|e| e.to_string())?;
        for (report, name, color) in [
            (cached, "with the paged KV cache (O(n) per token)", BLUE),
            (recomputed, "without a cache: K/V recomputed (O(n²))", RED),
        ] {
            chart
                .draw_series(
                    report
                        .step_times
                        .iter()
                        .map(|&(l, s)| Circle::new((l, 1e3 * s), 3, color.filled())),
                )
                .map_err(|e| e.to_string())?
                .label(name)
                .legend(move |(x, y)| Circle::new((x + 8, y), 4, color.filled()));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .border_style(BLACK)
            .background_style(WHITE.mix(0.9))
            .draw()
            .map_err(|e| e.to_string())?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}
